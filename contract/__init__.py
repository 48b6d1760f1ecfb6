"""What every package shares, and nothing heavy: the model's config, the tensor naming table, the
input checks and the artifact file names. Python and numpy only (no torch, no onnx): the export, the
serving side, the gateway and the client library all import it, and none of them imports another
for it (docs/design.md, "Layers")."""
