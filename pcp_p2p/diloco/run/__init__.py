"""One run on one node: the combining machine, its pump, and the node's side of training.

- :mod:`.run_machine`, :mod:`.run_effects` — the sans-IO machine that combines a run's
  election, worker and shepherd, and its typed inputs and effects;
- :mod:`.runtime` — the pump over the real node, with :mod:`.run_blobs`, :mod:`.run_dht`,
  :mod:`.run_audits`, :mod:`.run_setup`, :mod:`.run_status` for its I/O;
- :mod:`.engine` — training and evaluation on the IREE executor;
- :mod:`.training_service`, :mod:`.trust_file`, :mod:`.pins`, :mod:`.reputation` — a
  node's runs: which it accepts, what it keeps, whom it has banned;
- :mod:`.owner_commands`, :mod:`.run_commands` — ``pcp run ...``.

May import everything up to the node (:mod:`pcp_p2p.node`).

Layers, bottom to top (``tests/test_layers.py`` holds the same table and fails on
any import, at module level or inside a function, that runs up it): ``core`` <
``wire`` < ``dht`` < ``net`` < ``blob`` < ``compile`` < ``executor`` <
``diloco.algorithm`` < ``diloco.protocol`` < ``node`` < ``diloco.run`` <
``cluster`` < ``export`` < ``tui`` < ``testing`` < ``commands`` < ``cli``.
"""
