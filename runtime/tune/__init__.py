"""`runtime tune`: the pure search (search.py), servers and benchmark runs (runner.py), the
report (report.py) and the command (command.py); docs/architecture.md, the runtime row."""
