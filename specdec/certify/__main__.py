"""`python -m specdec.certify`: the certificate's command line (`specdec.certify.main`)."""

import sys

from specdec.certify import main

sys.exit(main())
