"""Operations on the checkpoint tree. Read-only ones return data; writing ones return a plan first."""
