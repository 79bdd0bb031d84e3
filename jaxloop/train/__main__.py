import sys

from jaxloop.train.cli import main

sys.exit(main())
