"""What a member holds: the training state and its encoding, checksum and random generators; its
transfer to newcomers; durable checkpoint files."""
