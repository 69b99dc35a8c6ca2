"""`python -m specdec.certify`: the certificate's command line (`specdec.certify.main`)."""

import sys

from specdec.certify import main

if __name__ == "__main__":
    sys.exit(main())
