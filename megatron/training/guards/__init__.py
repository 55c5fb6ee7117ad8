"""What stops a run, and how: a user's mistake as one error line and an exit code (errors.py),
token ids outside the vocabulary (token_guard.py), non-finite losses and gradients
(nan_guard.py), SIGTERM/SIGINT (exit_signal.py), and the deliberate failures the tests inject
(fault_injection.py)."""
