"""The sample makers: one module per framework, each a script run under torchrun that trains and saves samples
with the framework's own save path."""
