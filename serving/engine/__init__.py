"""The engine: what runs inside Triton's Python backend, with numpy and ONNX Runtime only (no torch,
no Triton, no gateway). ONNX Runtime's session and run options (`ort`), where a graph runs
(`placement`, `tensorrt`), the stateless and inspection runners (`runner`), the static KV pool
(`kv_pool`), the two session engines and what they share (`steps`, `static_engine`, and the fallback
in its own room, `concat`: the concat engine with its batching, store and copies), session snapshots
(`snapshots`), live sequences (`sequences`), errors, and the engines made from files and settings
(`factory`, `settings`). The export's parity ladder drives the same pool (export/ imports this
room; this room imports nothing of export/)."""
