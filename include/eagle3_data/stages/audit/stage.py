"""Stage 1, the tokenizer audit: every special id derived by name and round-tripped, before any
generation request is sent (a wrong expectation costs nothing)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3_data.errors import UserError
from eagle3_data.runs.results import AuditResult
from eagle3_data.runs.reuse import settle
from eagle3_data.runs.run import Run, stage_ref, tokenizer_for
from eagle3_data.stages import AUDIT, AUDIT_DATASET, AUDIT_REPORT

if TYPE_CHECKING:
    from eagle3_data.storage.store import ArtifactStore


def audit_tokenizer(run: Run, store: ArtifactStore) -> AuditResult:
    from eagle3_data.stages.audit.tokenizer_audit import audit_tokenizer as audit

    audited = audit(tokenizer_for(run, store), run.config.tokenizer.expected_special_ids, run.config.model.family)
    report = audited.to_json()
    ref = stage_ref(run, AUDIT, AUDIT_DATASET)
    # every id checked (the family's and the config's): a config that moved the family's ids out of
    # its expected_special_ids audits the same ids, and its committed audit is reused
    params = {"source": run.config.tokenizer.source, "expected": audited.expected}
    if not report["passed"]:  # a wrong expected id or tokenizer: bad config (exit 2, as `tokenizer audit`), not a gate
        # the report is kept to read where no audit was committed: a refused run changes no committed object
        kept = "" if store.is_complete(ref) else f"; report: {store.put_json(ref, AUDIT_REPORT, report)}"
        raise UserError(f"tokenizer audit failed: {'; '.join(report['problems'])}{kept}")
    hashes = {"tokenizer_sha256": report["tokenizer_sha256"], "template_sha256": report["chat_template_sha256"]}
    if settle(run, store, ref, [], params, what="tokenizer audit", hashes=hashes) is not None:
        return AuditResult(store.uri(ref, AUDIT_REPORT), report["tokenizer_sha256"])
    uri = store.put_json(ref, AUDIT_REPORT, report)
    store.commit_files(ref, [AUDIT_REPORT], params=params, **hashes)
    return AuditResult(uri, report["tokenizer_sha256"])
