import signal
import sys

from .commands import main

# `status | head` ends quietly. Here, not in main(): the tests call main() in pytest's own process,
# which would then die of its next write to a closed pipe or socket.
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
sys.exit(main())
