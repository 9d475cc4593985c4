"""The tracer's room: how readfence turns a stage's Python into an FX graph of reads.

Recording a stage (``_record``), splicing pure segments (``_segment``), matching tensors to
shared buffers by memory (``_memory``), the schema-driven alias analysis (``_alias``,
``_schema``), what an op's real run shows (``_probe``), triton launches as ops
(``_triton``) and what a kernel reads and writes (``_kernel_ir`` from triton's IR, ``_ttir`` its
dataflow, ``_kernel_access`` the source-walk fallback), the dispatch-mode base (``_dispatch``), FX builders (``_fx``),
the collector held off (``_collect``), escapes and the user's source line (``_escapes``), the
modes a stage is traced under, which mark them (``_trace_modes``), a
stage's graph analysed and its writes refused (``_analysis``), captured tensors matched by memory
(``_captured``), the tracer that ties them into a ``Program`` (``_trace``), the program bound to
the live state (``_bind``) and the caches of traces (``_cache``). This package imports nothing at load time: ``readfence.core`` and its internal API
name what the rest of readfence uses.
"""
