"""What every layer of PCP may use: errors, identities, content ids, process plumbing.

- :mod:`.errors` — the one exception hierarchy (``PcpError``: local or remote);
- :mod:`.identity` — a node's Ed25519 key, which is also its libp2p peer id;
- :mod:`.cid` — content identifiers, the names of blobs;
- :mod:`.logs`, :mod:`.shutdown` — logging and signal handling, once per process;
- :mod:`.faults` — the error boundary: whose fault an exception is (local, remote, peer);
- :mod:`.launch` — which launcher (mpiexec, srun) started this process, from its
  environment alone (a worker group's ranks and the executor's children read it).

The bottom layer: it imports nothing of PCP but the package root's version.

Layers, bottom to top (``tests/test_layers.py`` holds the same table and fails on
any import, at module level or inside a function, that runs up it): ``core`` <
``wire`` < ``dht`` < ``net`` < ``blob`` < ``compile`` < ``executor`` <
``diloco.algorithm`` < ``diloco.protocol`` < ``node`` < ``diloco.run`` <
``cluster`` < ``export`` < ``tui`` < ``testing`` < ``commands`` < ``cli``.
"""
