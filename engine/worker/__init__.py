"""The runtime every worker process shares (prefill, decode, colocated).

process.Worker      assembles one worker and runs its life: start, serve, drain, close
runtime.WorkerControl ZeroMQ: Register/RegisterAck, heartbeats, Peers, pool queries, Shutdown
peers.PeerLinks     one cached DEALER per peer worker (P<->D control messages)
transfer.TransferPlane  kvtransfer's transport over this worker's KV cache, one peer per pair
stepper.StepLoop    the engine's steps: forward on a thread, engine state on the event loop
role.WorkerRole     request table, dispatch, leases, deadlines; subclassed by prefill/ and decode/
metrics, logs, settings, convert: Prometheus + /livez /readyz, structlog, flags, proto <-> engine
"""
