"""`python -m s3stream ...` is the `s3stream` command (works whether or not scripts are on PATH)."""
from .cli import main

main()
