"""DiLoCo: the training algorithm of a PCP run, split by concern into three layers.

- :mod:`.algorithm` — the numbers: Δ and θ as bytes, sparse codecs, the outer
  Nesterov step, robust combining, data assignment, checkpoints. No messages, no I/O.
- :mod:`.protocol` — the sans-IO round machines (worker, shepherd, election), their
  wire messages, signed records and checks (spec, admission, audits, commits).
  May import the algorithm, never the node.
- :mod:`.run` — one run on one node: the combining machine (``run_machine``) and the
  runtime that pumps it over a :class:`~pcp_p2p.node.node.Node`, the engine that trains
  on the executor, the training service and the run owner's commands.

The subpackages re-export nothing, so importing one module never drags in the
others' dependencies.

Layers, bottom to top (``tests/test_layers.py`` holds the same table and fails on
any import, at module level or inside a function, that runs up it): ``core`` <
``wire`` < ``dht`` < ``net`` < ``blob`` < ``compile`` < ``executor`` <
``diloco.algorithm`` < ``diloco.protocol`` < ``node`` < ``diloco.run`` <
``cluster`` < ``export`` < ``tui`` < ``testing`` < ``commands`` < ``cli``.
"""
