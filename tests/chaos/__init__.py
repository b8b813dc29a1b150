"""Multi-host scenarios: network namespaces with sshd on one machine (root; docs/chaos.md)."""
