"""One module per framework; each is a script run under torchrun that trains and saves samples."""
