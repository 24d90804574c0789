import sys

from poddaemon.daemon import main

sys.exit(main())
