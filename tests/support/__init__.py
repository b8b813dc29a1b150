"""Helpers the tests import (`from tests.support.jobs import ...`); no tests here.

paths: where the repository, tests/scripts and tests/data are. jobs: starting launcher
processes and always stopping them. runs: what a run left behind (commits, sizes, digests,
fired faults). exactly_once: the samples.jsonl check. checkpoints: small checkpoint-test tools.
s3_server: SeaweedFS for the S3 tests. local_http: an HTTP(S) API stand-in. netns and
elastic_run: the chaos harness and its elastic job.
"""
