"""Many models from one server (`pagoda serve --models-dir DIR`, `--model NAME=PATH`,
`--stored-models`), each loaded on its first request into a `pagoda serve` process of
its own, the most recently used kept, idle ones unloaded (torch-free: this process
only relays).

    host.py     ModelHost: loading, room (count and memory), unloading, keep-alive
    app.py      the HTTP app: routes relayed by the body's model; run_model_host
    metrics.py  HostMetrics: its /metrics
The catalog of names is pagoda.model_executor.model_catalog.
"""
