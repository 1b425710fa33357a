"""The instructor's side: release, install source, the nbgrader round trip, class grading, its sandbox, the Hub."""
