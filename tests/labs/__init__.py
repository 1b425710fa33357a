"""The labs: each solution notebook executed and checked, their shared promises, and all of them in a browser."""
