"""The pictures' palette: one colour per kind of thing (a send, a receive, waiting, compute, a
collective), shared by the timeline, the profile and prediction against measurement."""

# One colour per kind of thing, so the same op looks the same in every lab.
COLORS = {
    "send": "#1f77b4",
    "isend": "#1f77b4",
    "recv": "#ff7f0e",
    "irecv": "#ff7f0e",
    "wait": "#c7c7c7",
    "region": "#2ca02c",
    "collective": "#9467bd",
}
