import sys

from afd.kernels import main

sys.exit(main())
