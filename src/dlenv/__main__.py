"""`python -m dlenv VERB ...` is the same as `dlenv VERB ...`."""

from dlenv.cli import main

raise SystemExit(main())
