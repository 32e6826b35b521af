import sys

from lowbit.lab.cli import main

sys.exit(main())
