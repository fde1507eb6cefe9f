"""DiLoCo: the training algorithm of a PCP run, as sans-IO state machines.

Modules (imported directly; this package re-exports nothing, so that importing
one of them never drags in the others' dependencies):

- :mod:`.spec` — the TOML run spec, signed by its owner; the run id.
- :mod:`.data` — the character corpus, the 90/10 split, per-worker shards and batches.
- :mod:`.messages` — Join, RoundAnnouncement, Submission, CommitRecord (wire messages).
- :mod:`.tensors` — θ / Δ as bytes (the blob layer's codecs), θ CIDs, norms.
- :mod:`.aggregate` — admission checks and the token-weighted mean of one round.
- :mod:`.outer` — the outer Nesterov step and the outer state (θ, v, round).
- :mod:`.checkpoint` — the outer state as one content-addressed blob.
- :mod:`.effects` — what the machines ask the world to do.
- :mod:`.shepherd`, :mod:`.worker` — the round protocol's two state machines.
- :mod:`.audit` — audits by deterministic replay: the draw, the inner-state chain,
  requests, reports and evidence for the ban ledger.
- :mod:`.sim` — an in-memory swarm on trio with seeded fault injection.
- :mod:`.lifecycle` — the owner's signed stop order, and the phase a run shows.
- :mod:`.run_commands` — ``pcp run status | watch | stop``.

The protocol is described in ``docs/diloco.md``.
"""
