"""Jobs: their records and store, what clients ask of them, the reports sites send,
services and gangs."""
