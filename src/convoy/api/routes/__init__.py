"""The HTTP app's routes over the Batch API's job engine (convoy.batch)."""
