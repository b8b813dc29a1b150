"""In place across hosts: one agent per host (`host_agent`), the generations agreed among the
agents (`decide` says what the next one is; `embedded` and `etcd_agreement` carry the agreement),
and the launch that starts an agent on every host (`fanout`)."""
