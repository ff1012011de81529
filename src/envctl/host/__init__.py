"""Host adapters: the only code that reads or changes the kernel."""
