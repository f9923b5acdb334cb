import sys

from shardkeeper.cli import main

sys.exit(main())
