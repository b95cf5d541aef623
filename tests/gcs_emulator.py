"""What the GCS emulator of tests/object_stores.py lacks and the engines need, as a fixture
that a gs:// test asks for (import it into the test module; it could become part of the
emulator's own fixture there, for every gs:// test)."""

import pytest


@pytest.fixture
def gcs_like_google(gcs_server, monkeypatch):
    """Three answers of GCS that gcp-storage-emulator lacks, for the test (put back afterwards):
    - object reads carry the object's generation (`x-goog-generation`). Orbax's OCDBT store
      reads its manifest and rewrites it on the condition of that generation: without it
      tensorstore refuses the write ("Malformed StorageGeneration") once a second array's
      store reads the manifest the first one wrote;
    - `moveTo` (GCS's rename of an object), which gcsfs's rename tries first. The emulator
      answers 501, which gcsfs retries with backoff for 32 s before it copies and deletes:
      DCP commits every save by renaming its `.metadata` into place;
    - a bucket is deleted though an upload into it never finished: a killed process leaves
      its resumable upload open (gcsfs uploads Orbax's small files so, through etils; GCS
      lets such a session expire), and the emulator refuses (409) to delete the bucket
      then. Ask for this fixture before the bucket, so that the bucket's removal comes
      first."""
    from http import HTTPStatus

    from gcp_storage_emulator import server, settings
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects
    from gcp_storage_emulator.storage import Storage

    def with_generation(handler):
        def read(request, response, storage, *args, **kwargs):
            handler(request, response, storage, *args, **kwargs)
            params = request.params
            try:
                obj = storage.get_file_obj(params["bucket_name"], params["object_id"])
            except NotFound:
                return
            response["x-goog-generation"] = obj["generation"]
            response["x-goog-metageneration"] = obj["metageneration"]

        return read

    def move(request, response, storage, *args, **kwargs):
        params = request.params
        params["dest_bucket_name"] = params["bucket_name"]  # moveTo stays in its bucket.
        objects.copy(request, response, storage)
        if response.status == HTTPStatus.OK:
            storage.delete_file(params["bucket_name"], params["object_id"])

    delete_bucket = Storage.delete_bucket

    def delete_bucket_and_its_uploads(self, bucket_name):
        for upload in [k for k, obj in self.resumable.items() if obj.get("bucket") == bucket_name]:
            self.delete_resumable_file_obj(upload)
        delete_bucket(self, bucket_name)

    monkeypatch.setattr(Storage, "delete_bucket", delete_bucket_and_its_uploads)
    for _, handlers in server.HANDLERS:
        if handlers.get(server.GET) in (objects.get, objects.download):
            monkeypatch.setitem(handlers, server.GET, with_generation(handlers[server.GET]))
    moves = tuple(
        (
            rf"^{prefix}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/"
            r"(?P<dest_object_id>.*[^/]+)$",
            {server.POST: move},
        )
        for prefix in (settings.API_ENDPOINT, "")
    )
    monkeypatch.setattr(server, "HANDLERS", moves + server.HANDLERS)
