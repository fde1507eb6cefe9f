"""Run admission (open / allowlist, owner-signed amendments), the allowlist DHT
record, the shepherd's refusals, and the reputation ledger on disk."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import msgpack
import numpy as np
import pytest

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import (
    BadSignature,
    ExpiredRecord,
    MalformedMessage,
    RejectedUpdate,
    StaleMessage,
    VerificationError,
)
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import CLOCK_SKEW_S, MAX_RECORD_SIZE, record_key, sign_record, verify_record
from pcp_p2p.dht.validator import PcpRecordValidator
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.algorithm.params import pack_tensors
from pcp_p2p.diloco.protocol.admission import (
    ALLOWLIST_KIND,
    MAX_AMENDED,
    Admission,
    AllowlistUpdate,
    allowlist_name,
    amend,
    sign_update,
    update_record,
)
from pcp_p2p.diloco.protocol.effects import Committed, Rejected, Send
from pcp_p2p.diloco.protocol.messages import Join, RoundAnnouncement, Submission, sign
from pcp_p2p.diloco.protocol.shepherd import Shepherd
from pcp_p2p.diloco.protocol.spec import parse_spec, run_id_of, sign_spec
from pcp_p2p.diloco.run.reputation import LEDGER_FILE, MAX_EVIDENCE_BYTES, ReputationLedger
from pcp_p2p.node.record_kinds import RECORD_KINDS
from pcp_p2p.wire import decode, encode, signing_bytes


def ident(i: int) -> Identity:
    return Identity(bytes([i]) * 32)


OWNER, STRANGER = ident(1), ident(2)
W = [ident(10 + i) for i in range(4)]  # W[0..2] listed in the spec; W[3] not
SHEPHERD = W[0]
NOW = 1_000.0


def spec_text(mode: str, shepherds: tuple[Identity, ...] = ()) -> str:
    listed = ", ".join(f'"{w.peer_id}"' for w in W[:3])
    leads = ", ".join(f'"{w.peer_id}"' for w in shepherds)
    return f"""
[inner]
lr = 0.01
batch_size = 2
seq_len = 4
[round]
time_budget_s = 10.0
deadline_s = 20.0
max_inner_steps = 20
rounds = 5
min_quorum = 2
delta_codec = "fp32"
[admission]
mode = "{mode}"
allowlist = [{listed}]
shepherds = [{leads}]
"""


def signed_run(mode: str = "allowlist", shepherds: tuple[Identity, ...] = (), owner: Identity = OWNER):
    return sign_spec(parse_spec(spec_text(mode, shepherds)), owner)


ALLOW = signed_run("allowlist")
RUN_ID = run_id_of(ALLOW)


def update(seq: int, *, add=(), remove=(), by: Identity = OWNER, run_id: str = RUN_ID, now: float = NOW):
    return sign_update(by, run_id, seq, add=[p.peer_id for p in add], remove=[p.peer_id for p in remove], now=now)


# --- open vs allowlist, shepherds ------------------------------------------------------


def test_open_run_admits_every_peer_but_the_removed():
    adm = Admission.for_run(signed_run("open"))
    assert adm.admits(STRANGER.peer_id) and adm.admits(W[3].peer_id)
    assert adm.members() is None
    adm.apply(update(1, remove=[STRANGER], run_id=adm.run_id), NOW)
    assert not adm.admits(STRANGER.peer_id) and "removed" in adm.why_not(STRANGER.peer_id)
    assert adm.admits(W[3].peer_id)


def test_allowlist_run_admits_the_listed_and_the_owner_only():
    adm = Admission.for_run(ALLOW)
    for w in W[:3]:
        assert adm.admits(w.peer_id) and adm.why_not(w.peer_id) is None
    assert adm.admits(OWNER.peer_id)
    assert not adm.admits(W[3].peer_id) and not adm.admits(STRANGER.peer_id)
    assert adm.why_not(STRANGER.peer_id) == "not on the run's allowlist"
    assert adm.members() == {OWNER.peer_id, *(w.peer_id for w in W[:3])}


def test_may_lead_needs_admission_and_the_shepherds_list_when_there_is_one():
    anyone = Admission.for_run(ALLOW)
    assert anyone.may_lead(W[1].peer_id) and not anyone.may_lead(STRANGER.peer_id)
    only = Admission.for_run(signed_run("allowlist", shepherds=(W[0],)))
    assert only.may_lead(W[0].peer_id)
    assert only.admits(W[1].peer_id) and not only.may_lead(W[1].peer_id)
    assert only.why_not(W[1].peer_id, lead=True) == "not among the run's shepherds"
    # A listed shepherd the owner removed may no longer lead.
    only.apply(update(1, remove=[W[0]], run_id=only.run_id), NOW)
    assert not only.may_lead(W[0].peer_id)


# --- amendments: in order, replays, forgeries ------------------------------------------------


def test_amendments_apply_in_order_and_the_newest_is_the_whole_amendment():
    adm = Admission.for_run(ALLOW)
    first = update(1, add=[W[3]])
    adm.apply(first, NOW)
    assert adm.admits(W[3].peer_id) and adm.seq == 1
    # The CLI's merge: the second update keeps W[3] and removes W[1].
    second = amend(first, OWNER, RUN_ID, remove=[W[1].peer_id], now=NOW + 1)
    assert (second.seq, second.add, second.remove) == (2, (W[3].peer_id,), (W[1].peer_id,))
    adm.apply(second, NOW + 1)
    assert adm.admits(W[3].peer_id) and not adm.admits(W[1].peer_id)
    # A node that saw only the newest update (the DHT keeps one) knows the same.
    late = Admission.for_run(ALLOW)
    late.apply(second, NOW + 1)
    assert late.members() == adm.members()
    # Re-adding a removed peer takes it off the remove list.
    third = amend(second, OWNER, RUN_ID, add=[W[1].peer_id], now=NOW + 2)
    assert W[1].peer_id in third.add and third.remove == ()
    with pytest.raises(ValueError):
        amend(third, OWNER, RUN_ID, add=[W[2].peer_id], remove=[W[2].peer_id], now=NOW + 3)


@pytest.mark.parametrize("older", [1, 2], ids=["older", "replayed"])
def test_an_older_or_replayed_update_is_stale_and_changes_nothing(older):
    adm = Admission.for_run(ALLOW)
    adm.apply(update(2, remove=[W[1]]), NOW)
    with pytest.raises(StaleMessage):
        adm.apply(update(older, add=[W[3]]), NOW)
    assert adm.seq == 2 and not adm.admits(W[3].peer_id) and not adm.admits(W[1].peer_id)


def test_a_forged_update_is_refused_as_a_bad_signature():
    adm = Admission.for_run(ALLOW)
    genuine = update(1, add=[W[3]])
    by_stranger = dataclasses.replace(genuine, signature=STRANGER.sign(signing_bytes(genuine)))
    tampered = dataclasses.replace(genuine, add=(STRANGER.peer_id,))
    for bad in (by_stranger, tampered, dataclasses.replace(genuine, signature=b"")):
        with pytest.raises(BadSignature):
            adm.apply(bad, NOW)
    assert adm.seq == 0 and not adm.admits(W[3].peer_id) and not adm.admits(STRANGER.peer_id)


def test_an_update_by_another_owner_is_refused():
    adm = Admission.for_run(ALLOW)
    with pytest.raises(BadSignature, match="not the run's owner"):
        adm.apply(update(1, add=[STRANGER], by=STRANGER), NOW)
    assert not adm.admits(STRANGER.peer_id)


def test_an_update_for_another_run_is_refused():
    adm = Admission.for_run(ALLOW)
    other_run = run_id_of(signed_run("open"))
    with pytest.raises(VerificationError) as err:
        adm.apply(update(1, add=[STRANGER], run_id=other_run), NOW)
    assert type(err.value) is VerificationError and "another run" in str(err.value)
    assert adm.seq == 0


def test_a_future_dated_update_is_refused():
    adm = Admission.for_run(ALLOW)
    with pytest.raises(ExpiredRecord):
        adm.apply(update(1, add=[W[3]], now=NOW + CLOCK_SKEW_S + 60), NOW)
    adm.apply(update(1, add=[W[3]], now=NOW + CLOCK_SKEW_S - 1), NOW)  # within the skew
    assert adm.admits(W[3].peer_id)


def test_update_bounds_are_enforced_on_both_ends():
    many = [f"12D3KooW{i:044d}" for i in range(MAX_AMENDED + 1)]
    with pytest.raises(ValueError):
        sign_update(OWNER, RUN_ID, 1, add=many, now=NOW)
    with pytest.raises(ValueError):
        AllowlistUpdate(RUN_ID, OWNER.peer_id, 1, ("a",), ("a",), NOW)
    with pytest.raises(ValueError):
        AllowlistUpdate(RUN_ID, OWNER.peer_id, 0, (), (), NOW)
    # On the wire: a peer's oversized or inconsistent update is a MalformedMessage.
    body = {"run_id": RUN_ID, "owner": OWNER.peer_id, "seq": 1, "add": [], "remove": [], "issued": NOW,
            "signature": b""}
    for bad in ({"add": ["a", "a"]}, {"add": ["a"], "remove": ["a"]}, {"add": many}, {"seq": 0}, {"add": [""]}):
        data = msgpack.packb([AllowlistUpdate.VERSION, AllowlistUpdate.TAG, {**body, **bad}], use_bin_type=True)
        with pytest.raises(MalformedMessage):
            decode(data, AllowlistUpdate)
    # The largest update fits one DHT record, which verifies.
    peers = [Identity(i.to_bytes(32, "big")).peer_id for i in range(1, MAX_AMENDED + 1)]
    full = sign_update(OWNER, RUN_ID, 1, add=peers[:150], remove=peers[150:], now=NOW)
    rec = encode(update_record(full, OWNER, now=NOW))
    assert len(rec) <= MAX_RECORD_SIZE
    assert verify_record(rec, now=NOW, kinds=RECORD_KINDS).payload == full


# --- the DHT record kind ----------------------------------------------------------------------


def test_the_owners_record_verifies_under_its_key():
    up = update(1, add=[W[3]])
    rec = update_record(up, OWNER, now=NOW)
    assert rec.key == record_key(ALLOWLIST_KIND, f"{RUN_ID}.{OWNER.peer_id}") and rec.seq == 1
    assert verify_record(encode(rec), key=rec.key, now=NOW, kinds=RECORD_KINDS).payload == up


def test_a_strangers_record_under_the_owners_key_is_refused():
    v = PcpRecordValidator(RECORD_KINDS, now=lambda: NOW)
    key = record_key(ALLOWLIST_KIND, allowlist_name(RUN_ID, OWNER.peer_id))
    genuine = update(1, add=[W[3]])
    # The owner's genuine update, re-signed into a record by a stranger (a higher seq, to shadow).
    copied = sign_record(STRANGER, ALLOWLIST_KIND, allowlist_name(RUN_ID, OWNER.peer_id), genuine,
                         ttl_s=60, seq=99, now=NOW)
    with pytest.raises(BadSignature):
        v.validate(key, encode(copied))
    # The stranger's own update for the run, under the owner's key.
    own = sign_record(STRANGER, ALLOWLIST_KIND, allowlist_name(RUN_ID, OWNER.peer_id),
                      update(99, add=[STRANGER], by=STRANGER), ttl_s=60, seq=99, now=NOW)
    with pytest.raises(VerificationError):
        v.validate(key, encode(own))
    # The owner's update for another run, stored under this run's key.
    other = run_id_of(signed_run("open"))
    moved = sign_record(OWNER, ALLOWLIST_KIND, allowlist_name(RUN_ID, OWNER.peer_id),
                        update(5, run_id=other), ttl_s=60, seq=5, now=NOW)
    with pytest.raises(VerificationError):
        v.validate(key, encode(moved))
    # The stranger's own key holds its own update, which nobody reading the owner's key sees.
    v.validate(record_key(ALLOWLIST_KIND, allowlist_name(RUN_ID, STRANGER.peer_id)),
               encode(update_record(update(99, by=STRANGER), STRANGER, now=NOW)))
    # Among the values, only the owner's can win.
    good = encode(update_record(genuine, OWNER, now=NOW))
    assert v.select(key, [encode(copied), encode(own), good]) == 2


def test_the_highest_seq_wins_whatever_the_clocks_say():
    v = PcpRecordValidator(RECORD_KINDS, now=lambda: NOW)
    key = record_key(ALLOWLIST_KIND, allowlist_name(RUN_ID, OWNER.peer_id))
    newer_seq = encode(update_record(update(2, remove=[W[1]]), OWNER, now=NOW - 50))
    older_seq = encode(update_record(update(1, add=[W[3]]), OWNER, now=NOW))
    assert v.select(key, [older_seq, newer_seq]) == 1


# --- the shepherd ------------------------------------------------------------------------------

THETA0 = {"w": np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "b": np.ones(4, np.float32)}


def join(who: Identity, run_id: str = RUN_ID) -> Join:
    return sign(Join(run_id=run_id, worker=who.peer_id, target="cpu", tokens_per_s=100.0), who)


def submission(ann: RoundAnnouncement, who: Identity) -> Submission:
    sub = Submission(
        run_id=ann.run_id, term=ann.term, round=ann.round, attempt=ann.attempt, worker=who.peer_id,
        base_theta_cid=ann.theta_cid, codec="fp32", delta_cid=None,
        delta_inline=pack_tensors({k: np.full_like(v, 0.01) for k, v in THETA0.items()}, "fp32"),
        steps=10, tokens=10 * ALLOW.spec.tokens_per_step, losses=(1.0,) * 10,
    )
    return sign(sub, who)


def rejections(effects):
    return [e for e in effects if isinstance(e, Rejected)]


def shepherd_with(admission: Admission) -> Shepherd:
    return Shepherd(spec=ALLOW.spec, run_id=RUN_ID, identity=SHEPHERD, term=0,
                    state=OuterState.initial(THETA0), admit=admission.why_not)


def test_shepherd_refuses_a_non_admitted_join_with_the_reason():
    shep = shepherd_with(Admission.for_run(ALLOW))
    refused = rejections(shep.on_join(join(STRANGER), now=0.0))
    assert len(refused) == 1 and refused[0].peer == STRANGER.peer_id
    assert isinstance(refused[0].error, RejectedUpdate) and "not on the run's allowlist" in str(refused[0].error)
    assert STRANGER.peer_id not in shep.roster
    assert rejections(shep.on_join(join(W[1]), now=0.0)) == [] and W[1].peer_id in shep.roster


def test_a_worker_the_owner_removes_is_dropped_when_it_joins_again():
    adm = Admission.for_run(ALLOW)
    shep = shepherd_with(adm)
    shep.on_join(join(W[1]), now=0.0)
    adm.apply(update(1, remove=[W[1]]), NOW)
    refused = rejections(shep.on_join(join(W[1]), now=1.0))
    assert len(refused) == 1 and "removed by the owner's allowlist update #1" in str(refused[0].error)
    assert W[1].peer_id not in shep.roster


def test_a_banned_worker_is_refused_mid_round_and_the_round_commits_without_it(tmp_path):
    ledger = ReputationLedger.open(tmp_path, RUN_ID)
    adm = Admission.for_run(ALLOW, bans=ledger)
    shep = shepherd_with(adm)
    for w in W[:3]:
        shep.on_join(join(w), now=0.0)
    anns = [e.message for e in shep.tick(now=shep.join_grace_s) if isinstance(e, Send)]
    ann = anns[0]
    assert isinstance(ann, RoundAnnouncement) and len(ann.assignments) == 3
    ledger.ban(W[2].peer_id, b"signed audit evidence", "audit mismatch in round 0", now=NOW)
    effects = shep.on_submission(submission(ann, W[2]), now=3.0)
    refused = rejections(effects)
    assert len(refused) == 1 and isinstance(refused[0].error, RejectedUpdate)
    assert "banned from this run: audit mismatch in round 0" in str(refused[0].error)
    assert W[2].peer_id not in shep.roster  # not assigned in the next round
    # The banned worker is decided, so the two honest submissions close the round at once.
    effects = []
    for w in W[:2]:
        effects += shep.on_submission(submission(ann, w), now=4.0)
    commits = [e.record for e in effects if isinstance(e, Committed)]
    assert len(commits) == 1 and set(commits[0].participants) == {W[0].peer_id, W[1].peer_id}
    # Its later joins are refused too.
    assert rejections(shep.on_join(join(W[2]), now=5.0))


def test_a_shepherd_without_admit_takes_every_signed_join():
    shep = Shepherd(spec=ALLOW.spec, run_id=RUN_ID, identity=SHEPHERD, term=0, state=OuterState.initial(THETA0))
    assert rejections(shep.on_join(join(STRANGER), now=0.0)) == [] and STRANGER.peer_id in shep.roster


# --- the reputation ledger ----------------------------------------------------------------------


def test_bans_and_strikes_survive_a_restart(tmp_path):
    ledger = ReputationLedger.open(tmp_path, RUN_ID)
    ledger.credit(W[0].peer_id, now=1.0)
    ledger.strike(W[1].peer_id, "RejectedUpdate", now=2.0)
    ledger.strike(W[1].peer_id, "RejectedUpdate", now=3.0)
    ledger.strike(W[1].peer_id, "StaleMessage", now=4.0)
    evidence = b"\x00signed evidence\xff" * 10
    ban = ledger.ban(W[2].peer_id, evidence, "audit mismatch", now=5.0)
    assert ban.evidence_cid == cid_of(evidence)
    assert ledger.ban(W[2].peer_id, b"other", "again", now=6.0) is ban  # the first ban stands
    again = ReputationLedger.open(tmp_path, RUN_ID)
    assert again.banned(W[2].peer_id) and not again.banned(W[1].peer_id)
    b = again.ban_of(W[2].peer_id)
    assert (b.reason, b.evidence, b.evidence_cid, b.at) == ("audit mismatch", evidence, cid_of(evidence), 5.0)
    assert again.score_of(W[1].peer_id).strikes == {"RejectedUpdate": 2, "StaleMessage": 1}
    assert again.score_of(W[0].peer_id).accepted == 1
    assert again.score(W[0].peer_id) > again.score(STRANGER.peer_id) == 0.5 > again.score(W[1].peer_id)
    assert again.score(W[2].peer_id) == 0.0
    assert not list(tmp_path.glob("*.tmp"))
    # Admission consults it.
    adm = Admission.for_run(ALLOW, bans=again)
    assert not adm.admits(W[2].peer_id) and not adm.may_lead(W[2].peer_id)
    assert adm.may_lead(W[2].peer_id, local_bans=False)  # what every node agrees on: the signed lists
    assert cid_of(evidence) in adm.why_not(W[2].peer_id)


def test_strikes_are_saved_at_most_every_few_seconds_and_on_flush(tmp_path):
    ledger = ReputationLedger.open(tmp_path, RUN_ID)
    ledger.strike(W[1].peer_id, "RejectedUpdate", now=0.0)  # the first change is saved at once
    ledger.strike(W[1].peer_id, "RejectedUpdate", now=1.0)  # within SAVE_EVERY_S: in memory only
    on_disk = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert on_disk["peers"][W[1].peer_id]["strikes"] == {"RejectedUpdate": 1}
    ledger.flush(now=1.5)
    on_disk = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert on_disk["peers"][W[1].peer_id]["strikes"] == {"RejectedUpdate": 2}


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"\xff\xfe\x00", b"[]", b'{"version": 1, "run_id": "x", "peers": {}, "bans": {}}',
     b'{"version": 1, "run_id": "RUN", "peers": {"p": {"first_seen": "a"}}, "bans": {}}',
     b'{"version": 1, "run_id": "RUN", "peers": {}, "bans": {"p": {"reason": "r", "at": 1, '
     b'"evidence_cid": "c", "evidence": "not base64!"}}}'],
    ids=["truncated", "binary", "not-a-ledger", "another-run", "bad-type", "bad-evidence"],
)
def test_an_unreadable_ledger_starts_afresh_with_a_warning(tmp_path, caplog, content):
    path = tmp_path / LEDGER_FILE
    path.write_bytes(content.replace(b'"RUN"', json.dumps(RUN_ID).encode()))
    with caplog.at_level(logging.WARNING, logger="pcp.reputation"):
        ledger = ReputationLedger.open(tmp_path, RUN_ID)
    assert len(ledger) == 0 and ledger.bans() == []
    assert any("unreadable" in r.getMessage() for r in caplog.records)
    assert (tmp_path / (LEDGER_FILE + ".corrupt")).read_bytes() == content.replace(
        b'"RUN"', json.dumps(RUN_ID).encode())
    ledger.ban(W[0].peer_id, b"e", "r", now=1.0)  # and it works from then on
    assert ReputationLedger.open(tmp_path, RUN_ID).banned(W[0].peer_id)


def test_the_ledger_is_bounded(tmp_path):
    ledger = ReputationLedger.open(tmp_path, RUN_ID, max_peers=3, max_bans=2)
    for i in range(6):
        ledger.strike(f"peer{i}", "RejectedUpdate", now=float(i))
    assert len(ledger) == 3 and ledger.score_of("peer0") is None and ledger.score_of("peer5") is not None
    for i in range(40):  # distinct reasons per peer are capped, the rest counted as "other"
        ledger.strike("peer5", f"reason {i} " + "x" * 200, now=10.0)
    strikes = ledger.score_of("peer5").strikes
    assert len(strikes) <= 16 and all(len(k) <= 64 for k in strikes) and sum(strikes.values()) == 41
    big = b"x" * (MAX_EVIDENCE_BYTES + 1)
    assert ledger.ban("a", big, "r", now=1.0).evidence is None  # CID only
    ledger.ban("b", b"small", "r", now=2.0)
    ledger.ban("c", b"small", "r", now=3.0)
    assert [b.peer for b in ledger.bans()] == ["b", "c"]  # the oldest ban went first
    saved = ReputationLedger.open(tmp_path, RUN_ID, max_peers=3, max_bans=2)
    assert len(saved) <= 3 and {b.peer for b in saved.bans()} == {"b", "c"}


def test_a_failing_disk_keeps_the_ledger_in_memory(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    ledger = ReputationLedger(blocker / "sub" / LEDGER_FILE, RUN_ID)  # parent is a file: cannot save
    with caplog.at_level(logging.WARNING, logger="pcp.reputation"):
        ledger.ban(W[0].peer_id, b"e", "r", now=1.0)
    assert ledger.banned(W[0].peer_id) and any("not saved" in r.getMessage() for r in caplog.records)


# --- pcp run admit, end to end over libp2p on 127.0.0.1 ----------------------------------------


async def test_pcp_run_admit_publishes_owner_signed_updates(tmp_path: Path, caps) -> None:
    import subprocess

    import trio

    from pcp_p2p.node.local_swarm import pcp_command
    from pcp_p2p.node.node import NodeConfig, open_node

    async def pcp(*argv: str) -> subprocess.CompletedProcess[str]:
        return await trio.to_thread.run_sync(lambda: subprocess.run(
            [*pcp_command(), *argv], capture_output=True, text=True, timeout=120))

    (tmp_path / "run.toml").write_text(spec_text("allowlist"))
    member = W[3].peer_id
    config = NodeConfig(tmp_path / "boot", listen=("/ip4/127.0.0.1/tcp/0",), capabilities=caps, role="bootstrap")
    async with open_node(config) as boot:
        addr = boot.addrs()[0]
        owner = ("--bootstrap", addr, "--data-dir", str(tmp_path / "owner"), "--wait", "0", "--json")
        created = await pcp("run", "create", str(tmp_path / "run.toml"), *owner)
        assert created.returncode == 0, created.stderr
        run_id = json.loads(created.stdout)["run_id"]
        owner_id = json.loads(created.stdout)["owner"]

        first = await pcp("run", "admit", "--run", run_id, "--add", member, *owner)
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout) | {"nodes_reached": 0} == {
            "run_id": run_id, "seq": 1, "add": [member], "remove": [], "mode": "allowlist", "nodes_reached": 0}
        second = await pcp("run", "admit", "--run", run_id, "--remove", member, W[0].peer_id, *owner)
        assert second.returncode == 0, second.stderr
        assert json.loads(second.stdout)["seq"] == 2
        again = await pcp("run", "admit", "--run", run_id, *owner)  # neither flag: publish the latest again
        assert again.returncode == 0 and json.loads(again.stdout)["seq"] == 2, again.stderr

        # What every node reads from the DHT: the owner's latest update, which an Admission accepts.
        stored = await boot.get_record(ALLOWLIST_KIND, allowlist_name(run_id, owner_id))
        assert isinstance(stored, AllowlistUpdate) and stored.seq == 2
        assert stored.add == () and stored.remove == tuple(sorted((member, W[0].peer_id)))
        signed = await boot.get_record("run", run_id)
        adm = Admission.for_run(signed)
        adm.apply(stored, stored.issued)
        assert not adm.admits(member) and not adm.admits(W[0].peer_id) and adm.admits(W[1].peer_id)

        # Anyone else is told, in one line, that only the owner may amend the list.
        other = await pcp("run", "admit", "--run", run_id, "--add", STRANGER.peer_id, "--bootstrap", addr,
                          "--data-dir", str(tmp_path / "stranger"), "--wait", "0")
        assert other.returncode == 1 and "Traceback" not in other.stderr
        assert other.stderr.strip().splitlines()[-1].startswith("pcp: error:") and "owned by" in other.stderr
        both = await pcp("run", "admit", "--run", run_id, "--add", member, "--remove", member, *owner)
        assert both.returncode == 1 and "both added and removed" in both.stderr
        typo = await pcp("run", "admit", "--run", run_id, "--add", "12D3KooWnope", *owner)
        assert typo.returncode == 1 and "is not a peer id" in typo.stderr and "Traceback" not in typo.stderr
        assert (await boot.get_record(ALLOWLIST_KIND, allowlist_name(run_id, owner_id))).seq == 2
