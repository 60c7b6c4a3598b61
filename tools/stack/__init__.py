"""The development stacks: Kafka and Redis on 127.0.0.1 without containers
(`devstack.sh`; `--secure` for TLS, SASL and ACLs: `devstack_secure.sh`), Jaeger for
traces (`jaeger.sh`), and a stack of a test's own on free ports (`own_stack.py`)."""
