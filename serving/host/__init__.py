"""The host: the processes `python -m serving` runs and keeps running on a machine. Triton without
Docker (`launcher`), its supervisor (`supervisor`), N replicas behind Envoy (`fleet`, `envoy`), what
`python -m serving` puts in front of the gateway (`front`), and the life every child process shares:
its stop, its death with its owner, the removal of what a killed run left (`process`). It talks to
Triton through the client library and reads Triton's configs through serving/triton; it never
imports the engine, which runs inside Triton."""
