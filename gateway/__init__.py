"""The placement hop for gateways (``kvbroker placement serve``): an Envoy external processor
that asks the registry where a conversation's KV is and writes the answer as the hints the
fleet's own picker honours (llm-d's endpoint subset, Dynamo's pin headers). It imports only
``kvbroker.common`` and the generated ``kvbroker.v1``, like every part."""
