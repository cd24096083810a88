"""What the command-line tools share: their argument parser, and writes that Ctrl-C waits for.

The tools parse and check their arguments before they import jax, so a mistake is reported at
once, as one line on stderr, with exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading


class ArgumentParser(argparse.ArgumentParser):
  """argparse's parser whose mistakes are one line, `PROG: error: MESSAGE` (no usage block: the
  message names the argument), with exit status 2."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


@contextlib.contextmanager
def deferred_interrupt():
  """Ctrl-C inside the block is held until the block has ended, then raised as
  KeyboardInterrupt: a few writes that must never be cut in half finish first. Off the main
  thread, or where Python does not own the SIGINT handler, it changes nothing."""
  previous = signal.getsignal(signal.SIGINT)
  if threading.current_thread() is not threading.main_thread() or previous is None:
    yield
    return
  received = []
  signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)
  if received:
    raise KeyboardInterrupt
