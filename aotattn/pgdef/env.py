"""The environment variables pgdef reads (kept free of imports: offline hosts may lack psycopg)."""

DSN_ENV = "AOTATTN_PGDEF_DSN"  # the database, when --dsn is not given
HOME_ENV = "AOTATTN_PGDEF_HOME"  # the embedded server's work folder
PGBIN_ENV = "AOTATTN_PGDEF_PGBIN"  # a folder with initdb, pg_ctl and postgres
