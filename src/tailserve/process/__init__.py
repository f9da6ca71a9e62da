"""How every tailserve process runs: its event loop and the signals that stop it (loops.py),
and its full garbage collections on the loop's schedule (collector.py)."""
