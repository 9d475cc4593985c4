"""Audit: declared effects against traced reads, for every reference backend and combinator."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
import torch
from returns.result import Failure, Success

from readfence.backends import (
    deepseek_v4,
    dense,
    hybrid_linear,
    join,
    leaf,
    linear,
    minimax,
    page_meta,
    paged,
    redeclare,
    reference_compositions,
    select,
    softmax_attention,
    sparse,
    store_kv,
    tbo,
    trtllm_mha,
)
from readfence.core import SHARED_BUFFERS, AuditReport, ForwardMode, StageWriteError, Unsound, audit, clear_trace_cache
from readfence.core.internal import audit_report, late_read_fix
from readfence.effects import ReadEffect, ReadEnd
from tests.conftest import SMALL as CFG
from tests.conftest import first_of_each

M = ForwardMode

LEAVES = [paged(), trtllm_mha(), deepseek_v4(), deepseek_v4(dspark=True), linear(), sparse(), dense()]
BACKENDS = [
    *LEAVES,
    *reference_compositions().values(),
    select({M.DECODE: paged(), M.TARGET_VERIFY: deepseek_v4()}, default=dense()),
    join(paged(), linear()),
    tbo(deepseek_v4(dspark=True), paged(), trtllm_mha()),
]

SHORT = {"NONE": "-", "PRE_REPLAY": "PRE", "IN_REPLAY": "IN", "POST_REPLAY": "POST", "UNKNOWN": "UNK"}


def render(report: AuditReport) -> list[str]:
    """One line per node: ``path MODE buffer=declared/observed:verdict ...`` (from rows())."""
    lines: dict[tuple[str, str], list[str]] = {}
    for row in report.rows(detail=True):
        verdict = {"exact": "=", "unsound": "UNSOUND"}.get(row["verdict"], f"+{row['steps']}")
        cell = f"{row['buffer']}={SHORT[row['declared']]}/{SHORT[row['observed']]}{verdict}"
        lines.setdefault((row["backend"], row["mode"]), []).append(cell)
    return [f"{path} {mode} {' '.join(cells)}" for (path, mode), cells in lines.items()]


# The full audit table: per node of each backend tree and mode, for every shared buffer,
# declared/observed and the verdict ("=" exact, "+k" conservative by k steps). A select's or
# hybrid's arms the mode does not select are not run in it, so not audited there.
EXPECTED = """
paged DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
paged TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
paged DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
paged EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
paged IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
trtllm_mha DECODE req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=-/-=
trtllm_mha TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=IN/IN= state_slots=-/-=
trtllm_mha DRAFT_EXTEND req_to_token=POST/POST= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=-/-=
trtllm_mha EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/IN+2 state_slots=UNK/-+4
trtllm_mha IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
deepseek_v4 DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
deepseek_v4 TARGET_VERIFY req_to_token=POST/POST= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
deepseek_v4 DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
deepseek_v4 EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
deepseek_v4 IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
deepseek_v4 DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
deepseek_v4 TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
deepseek_v4 DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
deepseek_v4 EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
deepseek_v4 IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
linear DECODE req_to_token=-/-= seq_lens=-/-= swa_map=-/-= state_slots=IN/IN=
linear TARGET_VERIFY req_to_token=-/-= seq_lens=-/-= swa_map=-/-= state_slots=IN/IN=
linear DRAFT_EXTEND req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/IN+2
linear EXTEND req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/IN+2
linear IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
sparse DECODE req_to_token=POST/POST= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
sparse TARGET_VERIFY req_to_token=POST/POST= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
sparse DRAFT_EXTEND req_to_token=UNK/POST+1 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
sparse EXTEND req_to_token=UNK/POST+1 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
sparse IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
dense DECODE req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
dense TARGET_VERIFY req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
dense DRAFT_EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
dense EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
dense IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
tbo/primary/deepseek_v4 DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
tbo/children[0]/paged DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
tbo TARGET_VERIFY req_to_token=POST/IN+1 seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
tbo/primary/deepseek_v4 TARGET_VERIFY req_to_token=POST/POST= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
tbo/children[0]/paged TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
tbo DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo/primary/deepseek_v4 DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo/children[0]/paged DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo/primary/deepseek_v4 EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
tbo/children[0]/paged EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo/primary/deepseek_v4 IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo/children[0]/paged IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
hybrid DECODE req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=-/-=
hybrid/decode/trtllm_mha DECODE req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=-/-=
hybrid TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=IN/IN= state_slots=-/-=
hybrid/decode/trtllm_mha TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=IN/IN= state_slots=-/-=
hybrid DRAFT_EXTEND req_to_token=POST/POST= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=-/-=
hybrid/decode/trtllm_mha DRAFT_EXTEND req_to_token=POST/POST= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=-/-=
hybrid EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
hybrid/prefill/deepseek_v4 EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
hybrid IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
hybrid/decode/trtllm_mha IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
hybrid_linear DECODE req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=IN/IN=
hybrid_linear/children[0]/trtllm_mha DECODE req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=-/-=
hybrid_linear/children[1]/linear DECODE req_to_token=-/-= seq_lens=-/-= swa_map=-/-= state_slots=IN/IN=
hybrid_linear TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=IN/IN= state_slots=IN/IN=
hybrid_linear/children[0]/trtllm_mha TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=IN/IN= state_slots=-/-=
hybrid_linear/children[1]/linear TARGET_VERIFY req_to_token=-/-= seq_lens=-/-= swa_map=-/-= state_slots=IN/IN=
hybrid_linear DRAFT_EXTEND req_to_token=UNK/POST+1 seq_lens=UNK/PRE+3 swa_map=UNK/PRE+3 state_slots=UNK/IN+2
hybrid_linear/children[0]/trtllm_mha DRAFT_EXTEND req_to_token=POST/POST= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=-/-=
hybrid_linear/children[1]/linear DRAFT_EXTEND req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/IN+2
hybrid_linear EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/IN+2 state_slots=UNK/IN+2
hybrid_linear/children[0]/trtllm_mha EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/IN+2 state_slots=UNK/-+4
hybrid_linear/children[1]/linear EXTEND req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/IN+2
hybrid_linear IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
hybrid_linear/children[0]/trtllm_mha IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
hybrid_linear/children[1]/linear IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
minimax DECODE req_to_token=POST/POST= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
minimax/sparse/sparse DECODE req_to_token=POST/POST= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
minimax/dense/dense DECODE req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
minimax TARGET_VERIFY req_to_token=POST/POST= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
minimax/sparse/sparse TARGET_VERIFY req_to_token=POST/POST= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
minimax/dense/dense TARGET_VERIFY req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
minimax DRAFT_EXTEND req_to_token=UNK/POST+1 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
minimax/sparse/sparse DRAFT_EXTEND req_to_token=UNK/POST+1 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
minimax/dense/dense DRAFT_EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
minimax EXTEND req_to_token=UNK/POST+1 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
minimax/sparse/sparse EXTEND req_to_token=UNK/POST+1 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
minimax/dense/dense EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
minimax IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
minimax/sparse/sparse IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
minimax/dense/dense IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
per_stream DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=PRE/-+1 state_slots=-/-=
per_stream/members[0]/paged DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
per_stream/members[1]/trtllm_mha DECODE req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=-/-=
per_stream TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=IN/-+2 state_slots=-/-=
per_stream/members[0]/paged TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
per_stream/members[1]/trtllm_mha TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=IN/IN= state_slots=-/-=
per_stream DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
per_stream/members[0]/paged DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
per_stream/members[1]/trtllm_mha DRAFT_EXTEND req_to_token=POST/POST= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=-/-=
per_stream EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
per_stream/members[0]/paged EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
per_stream/members[1]/trtllm_mha EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/IN+2 state_slots=UNK/-+4
per_stream IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
per_stream/members[0]/paged IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
per_stream/members[1]/trtllm_mha IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
select DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
select/decode/paged DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
select TARGET_VERIFY req_to_token=POST/POST= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
select/target_verify/deepseek_v4 TARGET_VERIFY req_to_token=POST/POST= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
select DRAFT_EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
select/default/dense DRAFT_EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
select EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
select/default/dense EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
select IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
select/default/dense IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
join DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=IN/IN=
join/children[0]/paged DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
join/children[1]/linear DECODE req_to_token=-/-= seq_lens=-/-= swa_map=-/-= state_slots=IN/IN=
join TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=IN/IN=
join/children[0]/paged TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
join/children[1]/linear TARGET_VERIFY req_to_token=-/-= seq_lens=-/-= swa_map=-/-= state_slots=IN/IN=
join DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/IN+2
join/children[0]/paged DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
join/children[1]/linear DRAFT_EXTEND req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/IN+2
join EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/IN+2
join/children[0]/paged EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
join/children[1]/linear EXTEND req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/IN+2
join IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
join/children[0]/paged IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
join/children[1]/linear IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=PRE/PRE= state_slots=-/-=
tbo/primary/deepseek_v4 DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
tbo/children[0]/paged DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
tbo/children[1]/trtllm_mha DECODE req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=-/-=
tbo TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=IN/IN= state_slots=-/-=
tbo/primary/deepseek_v4 TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
tbo/children[0]/paged TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=
tbo/children[1]/trtllm_mha TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=IN/IN= state_slots=-/-=
tbo DRAFT_EXTEND req_to_token=UNK/POST+1 seq_lens=UNK/IN+2 swa_map=UNK/PRE+3 state_slots=UNK/-+4
tbo/primary/deepseek_v4 DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo/children[0]/paged DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo/children[1]/trtllm_mha DRAFT_EXTEND req_to_token=POST/POST= seq_lens=PRE/PRE= swa_map=PRE/PRE= state_slots=-/-=
tbo EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/IN+2 state_slots=UNK/-+4
tbo/primary/deepseek_v4 EXTEND req_to_token=PRE/PRE= seq_lens=PRE/PRE= swa_map=-/-= state_slots=-/-=
tbo/children[0]/paged EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo/children[1]/trtllm_mha EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/IN+2 state_slots=UNK/-+4
tbo IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo/primary/deepseek_v4 IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo/children[0]/paged IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
tbo/children[1]/trtllm_mha IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4
"""


@pytest.mark.slow
def test_full_audit_table_of_every_reference_backend_in_every_mode() -> None:
    lines = []
    for backend in BACKENDS:
        for mode in ForwardMode:
            result = audit(backend, mode, cfg=CFG, batch_sizes=[2])
            assert isinstance(result, Success), result.failure().message
            lines += render(result.unwrap())
    assert lines == EXPECTED_LINES


@pytest.mark.slow
@pytest.mark.parametrize("backend", LEAVES, ids=str)
def test_reference_leaves_read_the_same_at_every_batch_size(backend) -> None:
    # the table above is traced at batch size 2; the combinators only join their leaves
    for mode in ForwardMode:
        report = audit_report(backend, mode, cfg=CFG)
        assert report.batch_sizes == (1, 2, CFG.max_reqs)
        at_two = audit_report(backend, mode, cfg=CFG, batch_sizes=[2])
        assert report.observed == at_two.observed, mode


def test_the_table_has_every_verdict_kind_and_no_unsound_row() -> None:
    text = "\n".join(EXPECTED_LINES)
    assert "UNSOUND" not in text and "=" in text and "+1" in text and "+4" in text
    # four buffers per node line, every buffer of the schema named
    assert all(all(f" {b}=" in line for b in SHARED_BUFFERS) for line in EXPECTED_LINES)


# ------------------------------------------------------------------------------------------
# Mutation: a declaration one step too early is caught
# ------------------------------------------------------------------------------------------


def _lower_one(effect: ReadEffect, buffer: str, end: ReadEnd) -> ReadEffect:
    ends = {b: effect[b] for b in SHARED_BUFFERS}
    ends[buffer] = end
    return ReadEffect.of(ends, default=effect.default)


def _below(end: ReadEnd) -> ReadEnd:
    return ReadEnd(end.value - 1)


@pytest.mark.parametrize("backend", first_of_each(LEAVES, lambda b: "leaf"), ids=lambda b: str(b))
def test_mutants_declared_one_step_earlier_are_unsound_exactly_when_below_the_trace(backend) -> None:
    caught = kept = 0
    for mode in ForwardMode:
        report = audit_report(backend, mode, cfg=CFG)
        for entry in report.buffers:
            if entry.declared is ReadEnd.NONE:
                continue
            earlier = _below(entry.declared)
            declared = backend.read_effect(mode)
            mutant = redeclare(
                backend, lambda m, d=declared, b=entry.buffer, e=earlier, mm=mode: (
                    _lower_one(d, b, e) if m is mm else backend.read_effect(m)
                ),
            )
            result = audit(mutant, mode, cfg=CFG)
            if earlier < entry.observed:  # an exact declaration lowered: must be caught
                caught += 1
                assert isinstance(result, Failure), (mode, entry)
                bad = result.failure()
                assert (bad.path, bad.mode, bad.buffer) == (backend.name, mode, entry.buffer)
                assert (bad.declared, bad.observed) == (earlier, entry.observed)
                assert f"buffer {entry.buffer!r}" in bad.message and backend.name in bad.message
                assert bad.reader is not None and bad.reader[1] in bad.message
            else:  # a conservative declaration lowered by one: still sound
                kept += 1
                assert isinstance(result, Success), (mode, entry, result)
    assert caught > 0  # the test exercises real catches for every leaf


@pytest.mark.parametrize("backend", first_of_each(LEAVES, lambda b: "leaf"), ids=lambda b: str(b))
def test_declaring_any_read_buffer_one_step_before_its_observed_end_is_caught(backend) -> None:
    count = 0
    for mode in ForwardMode:
        report = audit_report(backend, mode, cfg=CFG)
        for entry in report.buffers:
            if entry.observed is ReadEnd.NONE:
                continue
            count += 1
            too_early = _lower_one(backend.read_effect(mode), entry.buffer, _below(entry.observed))
            mutant = redeclare(backend, lambda m, e=too_early, mm=mode: e if m is mm else backend.read_effect(m))
            bad = audit(mutant, mode, cfg=CFG).failure()
            assert isinstance(bad, Unsound)
            assert (bad.path, bad.buffer, bad.observed) == (backend.name, entry.buffer, entry.observed)
    assert count >= 4


def test_unsound_leaf_inside_a_combinator_is_named_by_its_path() -> None:
    early = redeclare(deepseek_v4(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY,
                                                              "seq_lens": ReadEnd.IN_REPLAY}))
    # the primary is early for its own body, which tbo never runs (its primary only prepares):
    # the root's fence is sound, the primary's finding is latent
    report = audit(tbo(early, paged()), M.TARGET_VERIFY, cfg=CFG).unwrap()
    assert [r.path for r in report.walk()] == ["tbo", "tbo/primary/deepseek_v4", "tbo/children[0]/paged"]
    assert report.unsound() == [] and report.sound
    (latent,) = report.latent()
    assert (latent.path, latent.buffer, latent.fence, latent.covered_by) == (
        "tbo/primary/deepseek_v4", "req_to_token", "tbo", None)
    assert latent.entry.reader is not None and latent.entry.reader[0] == "body"
    assert latent.message.startswith(
        "latent: tbo/primary/deepseek_v4 in mode TARGET_VERIFY declares buffer 'req_to_token' ends at IN_REPLAY "
        "but its own trace reads it until POST_REPLAY (last read by node ")
    assert "this tree never reads it that late: the fence of tbo (IN_REPLAY)" in latent.message
    # alone, where its own declaration places the fence, it is refused
    bad = audit(early, M.TARGET_VERIFY, cfg=CFG).failure()
    assert (bad.path, bad.buffer, bad.declared, bad.observed) == (
        "deepseek_v4", "req_to_token", ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY)
    # as a tbo child it attends: the root reads late, and the child is named as the reader
    bad = audit(tbo(paged(), early), M.TARGET_VERIFY, cfg=CFG).failure()
    assert (bad.path, bad.buffer, bad.fence) == ("tbo/children[0]/deepseek_v4", "req_to_token", "tbo")
    assert bad.message.endswith("; the fence of tbo is placed from its declaration, IN_REPLAY; "
                                + late_read_fix("req_to_token", ReadEnd.POST_REPLAY))
    assert [(p, e.buffer) for p, e in bad.report.unsound()] == [
        ("tbo/children[0]/deepseek_v4", "req_to_token"), ("tbo", "req_to_token")]

    early_linear = redeclare(linear(), lambda m: ReadEffect.of({"state_slots": ReadEnd.PRE_REPLAY}))
    bad = audit(hybrid_linear(trtllm_mha(), early_linear, pattern="01"), M.DECODE, cfg=CFG).failure()
    # both the combinator (which joins the lowered child) and the child are unsound: the
    # deepest guilty node is named
    assert (bad.path, bad.buffer) == ("hybrid_linear/children[1]/linear", "state_slots")
    assert {p for p, _ in bad.report.unsound()} == {"hybrid_linear", "hybrid_linear/children[1]/linear"}

    early_sparse = redeclare(sparse(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY,
                                                                "seq_lens": ReadEnd.IN_REPLAY}))
    bad = audit(minimax(early_sparse, dense()), M.DECODE, cfg=CFG).failure()
    assert (bad.path, bad.buffer) == ("minimax/sparse/sparse", "req_to_token")


# ------------------------------------------------------------------------------------------
# Report shape: rows, table, what is left to improve
# ------------------------------------------------------------------------------------------


def test_rows_and_table() -> None:
    report = audit(tbo(deepseek_v4(), paged()), M.TARGET_VERIFY, cfg=CFG).unwrap()
    rows = report.rows()
    assert set(rows[0]) == {"backend", "mode", "buffer", "declared", "observed", "verdict"}
    assert rows[0] == {"backend": "tbo", "mode": "TARGET_VERIFY", "buffer": "req_to_token",
                       "declared": "POST_REPLAY", "observed": "IN_REPLAY", "verdict": "conservative"}
    assert len(rows) == 3 * len(SHARED_BUFFERS)
    table = str(report).splitlines()
    assert table[0].split() == ["backend", "mode", "buffer", "declared", "observed", "verdict"]
    assert table[1].split() == ["tbo", "TARGET_VERIFY", "req_to_token", "POST_REPLAY", "IN_REPLAY",
                                "conservative", "+1", "(no", "metadata", "snapshot", "yet)"]
    assert table[-1] == ("11 exact, 1 conservative, 0 unsound; 2 POST_REPLAY (no metadata snapshot "
                         "yet), 0 UNKNOWN (not audited)")
    assert report.post_replay() == [("tbo", "req_to_token"), ("tbo/primary/deepseek_v4", "req_to_token")]
    assert report.not_audited() == []
    assert report.counts() == {"exact": 11, "conservative": 1, "unsound": 0, "latent": 0, "post_replay": 2,
                               "not_audited": 0}


def test_unknown_declarations_are_listed_as_not_audited() -> None:
    report = audit(paged(), M.EXTEND, cfg=CFG).unwrap()
    assert report.not_audited() == [("paged", b) for b in SHARED_BUFFERS]
    assert [r["verdict"] for r in report.rows()] == ["conservative"] * 4
    assert "(not audited)" in report.table().splitlines()[1]
    assert report.find("paged") is report


def test_unsound_table_names_the_reader() -> None:
    early = redeclare(sparse(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY,
                                                         "seq_lens": ReadEnd.IN_REPLAY}))
    bad = audit(early, M.DECODE, cfg=CFG).failure()
    line = bad.report.table().splitlines()[1]
    # the function and line that read it (here the reference helper sparse attends with), then stage and node
    assert re.search(r"unsound: read by \w+ at \w+\.py:\d+ \(body:", line) and bad.reader[1] in line, line
    assert bad.report.counts()["unsound"] == 1 and not bad.report.sound


def _longest_path_leaf(declared: ReadEffect) -> Any:
    """A leaf whose body reads the page table only for a batch at the longest context, a Python
    value its out-of-graph stage computes: a path the trace's example at batch size 2 does not take."""

    def out(mode, shared, batch):
        meta = page_meta(shared, batch)
        return {**meta, "longest": int(meta["kv_lens"].max())}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        got = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        if meta["longest"] >= CFG.max_ctx:
            got = got + shared["req_to_token"].index_select(0, batch["req_pool_indices"]).sum() * 0
        return got

    return leaf("long_path", attend, prepare_out_graph=out, declare={M.EXTEND: declared})


def test_in_a_step_that_is_not_replayed_a_read_on_a_varied_state_counts_and_the_report_names_it() -> None:
    # EXTEND runs its Python every step; it is run on the varied states too, one at the longest context
    early = _longest_path_leaf(ReadEffect.of({}, default=ReadEnd.PRE_REPLAY))
    bad = audit(early, M.EXTEND, cfg=CFG, batch_sizes=[2]).failure()
    assert bad.message == (
        "unsound declaration: long_path in mode EXTEND declares buffer 'req_to_token' ends at PRE_REPLAY but its "
        "Python reads it until POST_REPLAY (stage body's Python read it on a varied state: a path the trace's "
        "example did not take); " + late_read_fix("req_to_token", ReadEnd.POST_REPLAY)), bad.message
    rows = {r["buffer"]: r for r in bad.report.rows(detail=True)}
    assert (rows["req_to_token"]["verdict"], rows["req_to_token"]["reader"].partition(":")[0],
            rows["req_to_token"]["varied"]) == ("unsound", "body", True)
    assert not rows["seq_lens"]["varied"]  # read on the example's path: the trace's
    assert "unsound: read by body's Python on a varied state" in bad.report.table()
    honest = redeclare(early, lambda m: ReadEffect.of({"req_to_token": ReadEnd.POST_REPLAY}, default=ReadEnd.PRE_REPLAY))
    assert audit(honest, M.EXTEND, cfg=CFG, batch_sizes=[2]).map(lambda r: r.sound).value_or(False)
    # a read any run saw is a read: the step's ledger keeps it, whatever runs the next audit makes
    assert audit(early, M.EXTEND, cfg=CFG, batch_sizes=[2], observe_steps=0).failure().buffer == "req_to_token"
    # the trace alone takes the short path (observe_steps=0 runs nothing; the ledger forgotten first)
    clear_trace_cache()
    assert audit(early, M.EXTEND, cfg=CFG, batch_sizes=[2], observe_steps=0).map(lambda r: r.sound).value_or(False)


# ------------------------------------------------------------------------------------------
# A user's own backend (the README's way: backends.leaf)
# ------------------------------------------------------------------------------------------


def _user_prep(mode, shared, batch, meta):
    return page_meta(shared, batch)


def _user_attend(mode, layer, q, k, v, pools, shared, batch, meta):
    store_kv(pools, layer, batch["out_cache_loc"], k, v)
    return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])


def test_user_leaf_audits_correctly() -> None:
    mine = leaf("mine", _user_attend, prepare_in_graph=_user_prep, reads=["req_to_token", "seq_lens"])
    lines = []
    for mode in ForwardMode:
        lines += render(audit(mine, mode, cfg=CFG).unwrap())
    assert lines == [
        "mine DECODE req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=",
        "mine TARGET_VERIFY req_to_token=IN/IN= seq_lens=IN/IN= swa_map=-/-= state_slots=-/-=",
        "mine DRAFT_EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4",
        "mine EXTEND req_to_token=UNK/IN+2 seq_lens=UNK/IN+2 swa_map=UNK/-+4 state_slots=UNK/-+4",
        "mine IDLE req_to_token=UNK/-+4 seq_lens=UNK/-+4 swa_map=UNK/-+4 state_slots=UNK/-+4",
    ]
    # inside a combinator, by path
    report = audit(tbo(paged(), mine), M.DECODE, cfg=CFG).unwrap()
    assert [r.path for r in report.walk()] == ["tbo", "tbo/primary/paged", "tbo/children[0]/mine"]


def _view_prep(mode, shared, batch, meta):
    out = page_meta(shared, batch)
    out["head"] = shared["req_to_token"][:, :4]  # a view: no read here...
    return out


def _view_attend(mode, layer, q, k, v, pools, shared, batch, meta):
    o = _user_attend(mode, layer, q, k, v, pools, shared, batch, meta)
    return o + meta["head"].sum().to(o.dtype) * 0  # ...the read happens here, in the body


def test_a_read_through_a_view_counts_where_the_view_is_consumed() -> None:
    mine = leaf("viewer", _view_attend, prepare_in_graph=_view_prep, reads=["req_to_token", "seq_lens"])
    bad = audit(mine, M.DECODE, cfg=CFG).failure()
    assert (bad.buffer, bad.declared, bad.observed) == ("req_to_token", ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY)
    assert bad.reader[0] == "body"
    fixed = redeclare(mine, lambda m: ReadEffect.of({"req_to_token": ReadEnd.POST_REPLAY,
                                                     "seq_lens": ReadEnd.IN_REPLAY}))
    assert audit(fixed, M.DECODE, cfg=CFG).unwrap().find("viewer").buffers[0].verdict == "exact"


def _opaque_prep(mode, shared, batch, meta):
    out = page_meta(shared, batch)
    lens = shared["state_slots"].numpy()  # escapes to code the tracer cannot see
    out["slot0"] = torch.tensor(int(lens[0]))
    return out


def test_an_opaque_read_is_unknown_never_none() -> None:
    # an escape inside the graph: the stage runs as Python and may read any buffer on a path the
    # example did not take, until the replay's end; the array numpy hands out may be read through
    # at any later time: that buffer is UNKNOWN
    mine = leaf("opaque", _user_attend, prepare_in_graph=_opaque_prep, reads=["req_to_token", "seq_lens"])
    bad = audit(mine, M.DECODE, cfg=CFG).failure()
    assert (bad.buffer, bad.declared, bad.observed) == ("req_to_token", ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY)
    assert "stage prepare_in_graph, node " in bad.message and "escape: numpy()" in bad.message
    report = bad.report
    assert {b: report.observed[b] for b in SHARED_BUFFERS} == {
        **dict.fromkeys(SHARED_BUFFERS, ReadEnd.POST_REPLAY), "state_slots": ReadEnd.UNKNOWN}
    ((stage, _, why),) = report.opaque
    assert stage == "prepare_in_graph" and why.startswith("escape: numpy() at ") and "_opaque_prep" in why
    assert "a CUDA graph cannot capture it" in why
    # in a mode no graph captures, the same escape says so, and speaks of no CUDA graph
    extend = audit(mine, M.EXTEND, cfg=CFG)
    ((_, _, extend_why),) = (extend.failure().report if isinstance(extend, Failure) else extend.unwrap()).opaque
    assert "no graph captures this mode" in extend_why and "CUDA" not in extend_why, extend_why
    # the escaping buffer UNKNOWN and every other one POST_REPLAY is sound; anything earlier is not
    honest = redeclare(mine, lambda m: ReadEffect.of({"state_slots": ReadEnd.UNKNOWN}, default=ReadEnd.POST_REPLAY))
    assert audit(honest, M.DECODE, cfg=CFG).unwrap().counts()["unsound"] == 0
    slots_post = redeclare(mine, lambda m: ReadEffect.of({}, default=ReadEnd.POST_REPLAY))
    assert audit(slots_post, M.DECODE, cfg=CFG).failure().buffer == "state_slots"
    # under fake tensors the escape cannot be followed at all: everything is UNKNOWN, and it says why
    on_cuda = audit(mine, M.DECODE, cfg=CFG, device="cuda").failure()
    assert on_cuda.observed is ReadEnd.UNKNOWN
    assert "stage prepare_in_graph, node '(trace stopped)': numpy() escapes under fake tensors" in on_cuda.message
    assert "lower refuses it on CUDA (UncapturableStage)" in on_cuda.message


# ------------------------------------------------------------------------------------------
# Writes to shared state are rejected
# ------------------------------------------------------------------------------------------


def _writes_in_place(mode, shared, batch, meta):
    shared["req_to_token"].add_(0)
    return page_meta(shared, batch)


def _writes_out(mode, layer, q, k, v, pools, shared, batch, meta):
    torch.add(shared["seq_lens"], 0, out=shared["seq_lens"])
    return _user_attend(mode, layer, q, k, v, pools, shared, batch, meta)


def test_a_backend_writing_req_to_token_in_place_is_rejected() -> None:
    evil = leaf("evil", _user_attend, prepare_in_graph=_writes_in_place)
    with pytest.raises(StageWriteError) as info:
        audit(evil, M.DECODE, cfg=CFG)
    assert str(info.value) == (
        "backend 'evil' writes shared buffer 'req_to_token' in stage prepare_in_graph (node 'add_', "
        f"op aten.add_.Tensor, at {__file__}:{inspect.getsourcelines(_writes_in_place)[1] + 1} in _writes_in_place): "
        "its schema "
        "`aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!)` marks "
        "argument(s) self as written; stages may only read shared state (pools may be written) - "
        "compute into a fresh tensor instead"
    )
    with pytest.raises(StageWriteError, match=r"backend 'tbo/children\[0\]/evil' writes shared buffer "
                                              r"'req_to_token' in stage prepare_in_graph"):
        audit(tbo(paged(), evil), M.DECODE, cfg=CFG)


def test_an_out_write_to_a_shared_buffer_is_rejected() -> None:
    evil = leaf("evil_out", _writes_out, prepare_in_graph=_user_prep)
    with pytest.raises(StageWriteError) as info:
        audit(evil, M.TARGET_VERIFY, cfg=CFG, device="cuda")
    e = info.value
    assert (e.backend, e.stage, e.buffer, e.op) == ("evil_out", "body", "seq_lens", "aten.add.out")


def _writes_pools(mode, layer, q, k, v, pools, shared, batch, meta):
    pools["k_cache"].mul_(1.0)
    torch.mul(pools["v_cache"], 1.0, out=pools["v_cache"])
    return _user_attend(mode, layer, q, k, v, pools, shared, batch, meta)


def test_writes_to_pools_are_fine() -> None:
    ok = leaf("pool_writer", _writes_pools, prepare_in_graph=_user_prep, reads=["req_to_token", "seq_lens"])
    assert audit(ok, M.DECODE, cfg=CFG).unwrap().counts()["exact"] == 4


EXPECTED_LINES = [line for line in EXPECTED.strip().splitlines() if line]


def test_a_per_stream_member_is_judged_at_its_share_of_the_batch() -> None:
    # each member serves its share of a step (lowering splits the batch over the streams): a
    # member that reads late only on more than 3 requests is fine in a group of three, whose
    # shares of 8 are 3, 3 and 2, and early in a group of two (shares of 4)
    from tests.adversarial import CASES

    ok = audit(CASES["per_stream_share_member"].build(None), ForwardMode.DECODE, cfg=CFG).unwrap()
    member = ok.find("per_stream/members[1]/big_batch")
    assert member.batch_sizes == (1, 3) and member.placed and ok.sound  # 1: (1, 0, 0) hands it none
    assert ok.find("per_stream/members[2]/snapshot").batch_sizes == (2,)
    bad = audit(CASES["per_stream_half_batch_member"].build(None), ForwardMode.DECODE, cfg=CFG).failure()
    assert (bad.path, bad.buffer, bad.batch_size, bad.fence) == (
        "per_stream/members[1]/big_batch", "seq_lens", 4, "per_stream/members[1]/big_batch")
