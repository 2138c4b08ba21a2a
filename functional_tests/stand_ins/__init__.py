"""Stand-ins for libraries that need hardware this machine lacks, for tests only.

Each is installed by a test (imported before the library's caller), never by te_paged.
"""
