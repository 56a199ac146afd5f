"""The one seam to the database: the schema and the store that owns every statement."""
