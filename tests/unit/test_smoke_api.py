from tests.support import AUTH


async def test_healthz_needs_no_token(api):
    resp = await api.get("/healthz")
    assert resp.status == 200
    assert (await resp.json())["ok"] is True


async def test_info_needs_token(api):
    resp = await api.get("/api/v1/info")
    assert resp.status == 401
    body = await resp.json()
    assert body["error"]["code"] == "unauthorized"
    resp = await api.get("/api/v1/info", headers=AUTH)
    assert resp.status == 200
