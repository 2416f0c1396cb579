"""PySpark-driven load tests: distributed throughput and migration time, with reports and plots."""
