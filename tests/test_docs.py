"""The docs name what the code registers: every message tag, record kind and protocol id."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).parent.parent / "docs"


def test_protocol_doc_lists_every_message_kind_and_protocol() -> None:
    import pcp_p2p.blob.protocol as blob_protocol
    import pcp_p2p.blob.service
    import pcp_p2p.compile.manifest
    import pcp_p2p.diloco.run.runtime  # noqa: F401
    from pcp_p2p.net.membership import SWIM_PROTOCOL
    from pcp_p2p.node.doctor import SPEED_PROTOCOL
    from pcp_p2p.node.messaging import MSG_PROTOCOL
    from pcp_p2p.node.record_kinds import RECORD_KINDS
    from pcp_p2p.node.status import STATUS_PROTOCOL
    from pcp_p2p.wire import registered_types

    text = (DOCS / "protocol.md").read_text()
    for tag in registered_types():
        if not tag.startswith("test."):
            assert f"`{tag}`" in text, f"docs/protocol.md does not mention message {tag}"
    for kind in RECORD_KINDS:
        assert f"/pcp/{kind}/" in text, f"docs/protocol.md does not mention record kind {kind}"
    for pid in (MSG_PROTOCOL, STATUS_PROTOCOL, blob_protocol.PROTOCOL_ID, SWIM_PROTOCOL, SPEED_PROTOCOL):
        assert pid in text, f"docs/protocol.md does not mention {pid}"


def test_readme_has_the_two_commands() -> None:
    readme = (DOCS.parent / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme


def test_docs_name_only_source_files_that_exist() -> None:
    """A path ``pcp_p2p/.../x.py`` in the docs, the README or the examples names a file that is there."""
    import re

    root = DOCS.parent
    texts = [*DOCS.glob("*.md"), root / "README.md", *(root / "examples").glob("*.toml")]
    missing = sorted({f"{t.relative_to(root)}: {m}" for t in texts
                      for m in re.findall(r"(?<![\w/.])pcp_p2p(?:/\w+)+\.py\b", t.read_text())
                      if not (root / m).is_file()})
    assert not missing, "\n".join(missing)
