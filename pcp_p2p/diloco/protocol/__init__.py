"""DiLoCo's protocol: sans-IO machines, their messages, records and checks.

- :mod:`.spec` — the signed run spec; :mod:`.messages`, :mod:`.effects` — the round's
  wire messages and what the machines ask of the outside world;
- :mod:`.worker`, :mod:`.shepherd`, :mod:`.aggregate`, :mod:`.deadlines` — one round;
- :mod:`.election` — terms, leases, failover; :mod:`.admission`, :mod:`.lifecycle`,
  :mod:`.departures` — who may take part, how a run stops, who left;
- :mod:`.audit`, :mod:`.audit_desk`, :mod:`.group_replay`, :mod:`.group_split` —
  audits by replay, including a worker group's split;
- :mod:`.commits`, :mod:`.runs`, :mod:`.owner_runs` — the DHT records of a run.

No sockets, no clock: time comes in as an argument. May import the algorithm and the
layers below the node (core, wire, dht, net, blob, compile, executor).

Layers, bottom to top (``tests/test_layers.py`` holds the same table and fails on
any import, at module level or inside a function, that runs up it): ``core`` <
``wire`` < ``dht`` < ``net`` < ``blob`` < ``compile`` < ``executor`` <
``diloco.algorithm`` < ``diloco.protocol`` < ``node`` < ``diloco.run`` <
``cluster`` < ``export`` < ``tui`` < ``testing`` < ``commands`` < ``cli``.
"""
