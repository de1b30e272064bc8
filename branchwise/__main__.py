"""`python -m branchwise ...` runs the `branchwise` command (for environments without the script on PATH)."""

from branchwise.cli import app

app(prog_name="branchwise")
