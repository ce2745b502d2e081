"""Shim of the model-only harness (``harness.py``), loaded by ``site`` in every process of a
run (this folder is first on the run's ``PYTHONPATH``; see ``harness.upstream_env``).

- torch's rendezvous stores (torchrun's agent store for ``pp=2``, rank 0's ``env://`` store for
  ``pp=1``) listen on their loopback host only: torch binds them on every interface, the
  plugin's activation rebinds them (``mindspeed_flow.loopback.keep_stores_on_loopback``), and
  a run without the plugin gets the same here, so no run listens beyond 127.0.0.1.  Nothing
  the job computes changes.  Announced on stderr as ``[upstream harness] shim: NAME (why)``.
"""

from __future__ import annotations

import sys

from mindspeed_flow.loopback import keep_stores_on_loopback

keep_stores_on_loopback()
sys.stderr.write("[upstream harness] shim: torch rendezvous stores on 127.0.0.1 (torchrun's agent store, "
                 "env:// / tcp://: torch binds them on every interface; "
                 "mindspeed_flow.loopback.keep_stores_on_loopback)\n")
