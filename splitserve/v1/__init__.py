"""Generated protocol modules: serving_pb2, serving_pb2_grpc, control_pb2.

Do not edit; regenerate with `make proto` (python -m splitserve.protogen)."""

GENERATED_WITH = {'grpcio-tools': '1.85.1', 'mypy-protobuf': '5.1.0'}
