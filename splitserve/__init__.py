"""splitserve: the CLI, the client and the generated protocol modules."""
