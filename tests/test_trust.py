"""Trust you can manage: the trust file, runs findable by owner, refusal reasons, the quorum warning.

The unit tests drive the sans-IO parts (the trust file's parser, the run book,
the ``owner-runs`` record's rules); the network tests run real py-libp2p nodes
on 127.0.0.1 and the real ``pcp run create`` in a subprocess.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
from pathlib import Path

import msgpack
import pytest
import trio

from pcp_p2p.core.errors import BadSignature, ConfigError, MalformedMessage, PeerGone, Refused
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import record_key, sign_record
from pcp_p2p.dht.validator import PcpRecordValidator
from pcp_p2p.diloco.protocol.owner_runs import MAX_OWNED_RUNS, OWNER_RUNS_KIND, OwnedRun, OwnerRuns, with_run
from pcp_p2p.diloco.protocol.runs import MAX_HELD_UNTRUSTED, RunBook, TrustPolicy, UntrustedOwner
from pcp_p2p.diloco.protocol.spec import parse_spec, run_id_of, sign_spec
from pcp_p2p.diloco.run.owner_commands import HandOff, _handoff_summary
from pcp_p2p.diloco.run.trust_file import TrustFile, parse_trust_file
from pcp_p2p.node.record_kinds import RECORD_KINDS
from pcp_p2p.wire import decode, encode


def ident(i: int) -> Identity:
    return Identity(bytes([i]) * 32)


OWNER, STRANGER, OTHER = ident(41), ident(42), ident(43)
NOW = 1_000_000.0


def spec_text(name: str = "late", leader: Identity = STRANGER) -> str:
    # Only a peer that is not in the test may lead: the nodes take the run up and wait,
    # without compiling (what is tested is finding and joining, not training).
    return f"""
name = "{name}"
[round]
min_quorum = 2
[admission]
shepherds = ["{leader.peer_id}"]
"""


def signed(owner: Identity = OWNER, name: str = "late"):  # type: ignore[no-untyped-def]
    return sign_spec(parse_spec(spec_text(name)), owner)


# --- the trust file ------------------------------------------------------------------------


def test_trust_file_lists_owners_skips_comments_and_names_bad_lines() -> None:
    text = f"""# owners we train for
{OWNER.peer_id}
   {OTHER.peer_id}   # a trailing comment

12D3KooWnotapeerid
{OWNER.peer_id} {OTHER.peer_id}
"""
    owners, problems = parse_trust_file(text)
    assert owners == {OWNER.peer_id, OTHER.peer_id}
    assert [p.line for p in problems] == [5, 6]
    assert "not a peer id" in str(problems[0]) and "line 5" in str(problems[0])
    assert "one peer id per line" in problems[1].why


def test_trust_file_change_is_seen_and_a_bad_line_is_logged_once(tmp_path: Path, caplog) -> None:
    path = tmp_path / "trust"
    path.write_text("# nobody yet\nnot-a-peer\n")
    tf = TrustFile(path)
    with caplog.at_level(logging.WARNING, logger="pcp.trust"):
        assert tf.load() == frozenset()
        assert tf.poll() is None and tf.poll() is None  # unchanged: not parsed (nor logged) again
    assert [r.getMessage() for r in caplog.records if "line 2" in r.getMessage()] == [
        f"trust file {path}: line 2: 'not-a-peer' is not a peer id (skipped)"]

    tmp = tmp_path / "trust.new"  # an editor's save: write a new file, rename it over the old one
    tmp.write_text(f"not-a-peer\n{OWNER.peer_id}\n")
    tmp.replace(path)
    assert tf.poll() == {OWNER.peer_id}
    path.unlink()  # gone (mid-save, or by mistake): the last list stays, poll says nothing changed
    assert tf.poll() is None


def test_an_unreadable_trust_file_at_start_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read --trust-file"):
        TrustFile(tmp_path / "missing").load()


# --- the run book: refused for want of trust, taken up when trust comes ---------------------


def test_a_run_refused_for_want_of_trust_is_taken_up_when_its_owner_is_trusted() -> None:
    book = RunBook(TrustPolicy())
    run = signed()
    with pytest.raises(UntrustedOwner) as caught:
        book.offer(run)
    assert caught.value.refusal_reason == "not_trusted"
    assert book.unknown([run_id_of(run)]) == []  # refused: not looked up again and again
    assert book.retrust(TrustPolicy(frozenset({OTHER.peer_id}))) == []  # another owner: still refused
    taken = book.retrust(TrustPolicy(frozenset({OWNER.peer_id})))
    assert [r.run_id for r in taken] == [run_id_of(run)] and run_id_of(run) in book.runs
    assert book.offer(run) is None and not book.untrusted  # known now; nothing held


def test_a_run_this_machine_cannot_run_is_refused_with_that_reason() -> None:
    from pcp_p2p.compile.targets import TARGETS
    from pcp_p2p.diloco.protocol.runs import NoAllowedTarget
    from pcp_p2p.diloco.run.training_service import fits_this_machine
    from pcp_p2p.executor.cpu import best_cpu_target
    from pcp_p2p.node.messaging import refusal_of

    other = next(t for t in TARGETS if t != best_cpu_target().name)
    spec = parse_spec(spec_text() + f'[targets]\nallowed = ["{other}"]\n')
    run = sign_spec(spec, OWNER)
    book = RunBook(TrustPolicy(frozenset({OWNER.peer_id})), fits=fits_this_machine)
    with pytest.raises(NoAllowedTarget) as caught:
        book.offer(run)
    answer = refusal_of(caught.value)  # what the owner's `run create` is told
    assert answer.reason == "no_target" and best_cpu_target().name in answer.detail and other in answer.detail
    assert run_id_of(run) not in book.runs and not book.untrusted  # not held: more trust would not help
    assert book.offer(sign_spec(parse_spec(spec_text()), OWNER)) is not None  # the default targets fit


def test_the_held_untrusted_specs_are_bounded() -> None:
    book = RunBook(TrustPolicy())
    runs = [signed(STRANGER, f"flood{i}") for i in range(MAX_HELD_UNTRUSTED + 5)]
    for r in runs:
        with pytest.raises(UntrustedOwner):
            book.offer(r)
    assert len(book.untrusted) == MAX_HELD_UNTRUSTED
    assert run_id_of(runs[0]) not in book.untrusted and run_id_of(runs[-1]) in book.untrusted
    assert book.unknown([run_id_of(runs[0])]) == [run_id_of(runs[0])]  # dropped: findable again later


# --- the owner-runs record ---------------------------------------------------------------


def test_forged_owner_runs_records_are_refused_by_the_validator() -> None:
    validator = PcpRecordValidator(RECORD_KINDS, now=lambda: NOW)
    key = record_key(OWNER_RUNS_KIND, OWNER.peer_id)
    listing = with_run([], OWNER.peer_id, "bafyrun", now=NOW)
    genuine = sign_record(OWNER, OWNER_RUNS_KIND, OWNER.peer_id, listing, ttl_s=3600, now=NOW)
    assert validator.check(key, encode(genuine)).payload == listing

    # A stranger's list stored under the owner's key, in the owner's name.
    forged = sign_record(STRANGER, OWNER_RUNS_KIND, OWNER.peer_id, listing, ttl_s=3600, now=NOW)
    with pytest.raises(BadSignature):
        validator.validate(key, encode(forged))
    # The stranger's own key, but a payload claiming to be the owner's list.
    own_key = record_key(OWNER_RUNS_KIND, STRANGER.peer_id)
    claimed = sign_record(STRANGER, OWNER_RUNS_KIND, STRANGER.peer_id, listing, ttl_s=3600, now=NOW)
    with pytest.raises(BadSignature):
        validator.validate(own_key, encode(claimed))
    # The owner's signed bytes with one run id swapped: the signature no longer holds.
    tampered = dataclasses.replace(genuine, payload=encode(with_run([], OWNER.peer_id, "bafyevil", now=NOW)))
    with pytest.raises(BadSignature):
        validator.validate(key, encode(tampered))
    # And select never picks a forged value over the genuine one.
    assert validator.select(key, [encode(forged), encode(genuine)]) == 1


def test_owner_runs_lists_merge_expire_and_stay_bounded() -> None:
    old = OwnerRuns(OWNER.peer_id, (OwnedRun("expired", NOW - 1), OwnedRun("kept", NOW + 50)))
    other = OwnerRuns(OTHER.peer_id, (OwnedRun("not-ours", NOW + 50),))
    lst = with_run([old, other], OWNER.peer_id, "new", now=NOW, ttl_s=100)
    assert lst.live(NOW) == ["new", "kept"]
    many = OwnerRuns(OWNER.peer_id, tuple(OwnedRun(f"r{i}", NOW + i + 1) for i in range(MAX_OWNED_RUNS)))
    capped = with_run([many], OWNER.peer_id, "newest", now=NOW)
    assert len(capped.runs) == MAX_OWNED_RUNS and "r0" not in capped.live(NOW) and capped.live(NOW)[0] == "newest"
    version, tag, body = msgpack.unpackb(encode(many))  # a peer cannot hand us a longer list
    body["runs"].append(body["runs"][-1] | {"run_id": "one-more"})
    with pytest.raises(MalformedMessage, match="at most 64"):
        decode(msgpack.packb([version, tag, body]), OwnerRuns)


# --- what `pcp run create` prints --------------------------------------------------------


def test_run_create_names_each_refusal_and_what_to_do() -> None:
    owner = OWNER.peer_id
    handoff = HandOff(
        accepted=["12D3KooWaccepted"],
        refused=[("12D3KooWpeerA", Refused("x", reason="not_trusted", detail="run owner is not trusted")),
                 ("12D3KooWpeerB", Refused("x", reason="no_target", detail="best target cpu-aarch64 \x1b[31mred"))],
        unreachable=[("12D3KooWpeerC", PeerGone("stream closed"))],
    )
    lines = _handoff_summary(handoff, owner).splitlines()
    assert lines[0] == "handed to 1 node(s); 2 refused, 1 unreachable:"
    assert lines[1] == (f"  12D3KooWpeerA: not trusted (start it with --trust {owner}, "
                        f"or add {owner} to its --trust-file)")
    assert lines[2].startswith("  12D3KooWpeerB: cannot run the run's compile targets: best target cpu-aarch64")
    assert "\x1b" not in lines[2]  # a stranger's text never reaches the terminal raw
    assert lines[3] == "  12D3KooWpeerC: unreachable (stream closed)"


# --- over real libp2p ----------------------------------------------------------------------


async def test_a_declined_message_is_answered_with_its_reason(swarm3) -> None:
    _, a, b = swarm3
    run = signed()

    async def refuse(sender: str, msg: object) -> None:
        raise UntrustedOwner("run owner is not trusted by this node\x07\n(--trust)")

    b.messenger.register((type(run),), refuse)
    with pytest.raises(Refused) as caught:
        await a.messenger.send(b.peer_id, run)
    assert caught.value.reason == "not_trusted"
    assert caught.value.detail == "run owner is not trusted by this node  (--trust)"
    assert b.rejected["message:UntrustedOwner"] == 1


async def pcp_json(*argv: str) -> dict:
    from pcp_p2p.node.local_swarm import pcp_command

    res = await trio.to_thread.run_sync(lambda: subprocess.run(
        [*pcp_command(), *argv, "--json"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL))
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


async def wait_for_run(node, service, run_id: str, timeout: float = 45.0) -> None:  # type: ignore[no-untyped-def]
    """Until the node takes part in ``run_id``: no event says so, so look twice a second, bounded."""
    with trio.fail_after(timeout):
        # no event: a node takes a run up without notifying its waiters
        while run_id not in service.runtimes or run_id not in node.runs:  # noqa: ASYNC110
            await trio.sleep(0.5)


async def test_a_late_trusting_node_finds_an_existing_run_when_its_trust_file_changes(swarm3, tmp_path: Path) -> None:
    from pcp_p2p.diloco.run.training_service import install_training

    boot, a, b = swarm3
    (tmp_path / "run.toml").write_text(spec_text())
    a_file, b_file = tmp_path / "a.trust", tmp_path / "b.trust"
    for f in (a_file, b_file):
        f.write_text("# no owner trusted yet\n")
    a_training = install_training(a, TrustPolicy(), trust_file=TrustFile(a_file))
    owner = ("--bootstrap", boot.addrs()[0], "--data-dir", str(tmp_path / "owner"), "--wait", "10")

    # b takes no runs yet; a refuses: not trusted. Both say so to the owner, who is also
    # warned that its quorum of 2 exceeds the 0 nodes that took the run.
    created = await pcp_json("run", "create", str(tmp_path / "run.toml"), *owner)
    run_id, owner_id = created["run_id"], created["owner"]
    assert created["nodes_reached"] == 0 and created["min_quorum"] == 2
    assert [(r["peer"], r["reason"]) for r in created["refused"]] == [(a.peer_id, "not_trusted")]
    assert created["warnings"] and "round.min_quorum" in created["warnings"][0]

    # b starts training after the run was created, trusting nobody; no node advertises the run.
    b_training = install_training(b, TrustPolicy(), trust_file=TrustFile(b_file))
    assert not any(run_id in m.record.runs for m in boot.membership.live())

    def trust_owner(path: Path) -> None:
        path.write_text(f"# the owner\n{owner_id}\n")
        os.utime(path, ns=(0, 0))  # a new stamp even within one mtime tick (poll compares the stamp)

    # b's trust file names the owner: with no node advertising the run, b finds it by owner.
    trust_owner(b_file)
    await wait_for_run(b, b_training, run_id)
    assert b_training.book.trust.owners == {owner_id}
    # a's does too: a takes up the run it refused, held since the hand-off.
    trust_owner(a_file)
    await wait_for_run(a, a_training, run_id)
    # What b advertises to the swarm: it takes part in the run.
    await boot.wait_until(lambda: all(
        (m := boot.membership.get(n.peer_id)) is not None and run_id in m.record.runs for n in (a, b)), timeout=30)


# --- the CLI, end to end (processes) --------------------------------------------------------


def test_a_bad_trust_flag_or_missing_trust_file_is_one_error_line(tmp_path: Path) -> None:
    from pcp_p2p.node.local_swarm import pcp_command

    for extra, says in ((["--trust", "12D3KooWnope"], "is not a peer id"),
                        (["--trust-file", str(tmp_path / "missing")], "cannot read --trust-file")):
        res = subprocess.run([*pcp_command(), "node", "join", "--data-dir", str(tmp_path / "n"),
                              "--listen", "/ip4/127.0.0.1/tcp/0", *extra],
                             capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        errors = [line for line in res.stderr.splitlines() if line.startswith("pcp: error: ")]
        assert res.returncode == 1 and len(errors) == 1 and says in errors[0], res.stderr[-2000:]
        assert "Traceback" not in res.stderr


@pytest.mark.slow
async def test_pcp_node_join_trust_file_reload_and_run_create_report(tmp_path: Path) -> None:
    """``pcp node join --trust-file``: the run is refused with its reason and a quorum warning,
    then the file is edited and the node takes the run up, no restart.

    (Finding a run by owner is the in-process test above: in a swarm of processes on this
    shared machine, a node started after ``run create`` currently times out on DHT gets
    while the departed client lingers in routing tables, issue #19 item 6.)"""
    from pcp_p2p.node.local_swarm import local_swarm, pcp_command
    from pcp_p2p.node.status import to_json

    trust_file = tmp_path / "trust"
    trust_file.write_text("# owners\nnot-a-peer-id\n")
    (tmp_path / "run.toml").write_text(spec_text())

    async def run_of(swarm, proc) -> str | None:  # type: ignore[no-untyped-def]
        try:
            return (to_json(await swarm.status(proc)).get("run") or {}).get("run_id")
        except Exception:
            return None

    async def wait_until_in_run(swarm, proc, run_id: str) -> None:  # type: ignore[no-untyped-def]
        with trio.fail_after(60):  # polled: no cross-process event says "took the run up"
            while await run_of(swarm, proc) != run_id:  # noqa: ASYNC110  (another process)
                await trio.sleep(0.5)

    async with local_swarm(tmp_path) as swarm:
        boot = await swarm.start_bootstrap()
        worker = await swarm.add_worker(["--trust-file", str(trust_file)])
        created = await trio.to_thread.run_sync(lambda: subprocess.run(
            [*pcp_command(), "run", "create", str(tmp_path / "run.toml"), "--bootstrap", boot.addr,
             "--data-dir", str(tmp_path / "owner"), "--wait", "15"],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL))
        assert created.returncode == 0, created.stderr[-3000:]
        run_id = created.stdout.split()[1]
        owner_id = created.stdout.splitlines()[1].split()[1]
        assert "handed to 0 node(s); 1 refused:" in created.stderr, created.stderr
        assert f"  {worker.peer_id}: not trusted (start it with --trust {owner_id}" in created.stderr
        assert "pcp: warning: the run needs 2 workers per round (round.min_quorum) but 0 node(s)" in created.stderr

        tmp = tmp_path / "trust.new"
        tmp.write_text(f"# owners\nnot-a-peer-id\n{owner_id}\n")
        tmp.replace(trust_file)
        await wait_until_in_run(swarm, worker, run_id)

    log = (tmp_path / f"{worker.name}.log").read_text()
    assert log.count("line 2: 'not-a-peer-id' is not a peer id (skipped)") == 2  # once per version of the file
