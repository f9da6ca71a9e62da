"""How every tailserve process runs: its event loop and the signals that stop it (loops.py),
its full garbage collections on the loop's schedule (collector.py), and the children it starts
in sessions of their own at its session's CPU priority (sessions.py)."""
