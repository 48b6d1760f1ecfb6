"""Request and response bodies; their JSON Schemas are the OpenAPI document's.

Tensors are nested lists of the stated rank, or an `EncodedTensor` (see `encoding`). The schemas
fix ranks and element types; sizes depend on the served model (`GET /v1/models`) and are checked
against it, with a 400 that names the input and the expected and actual shape.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from serving.gateway.encoding import EncodedTensor, FiniteFloat, MaskBit

States = list[list[list[FiniteFloat]]] | EncodedTensor  # (batch, sequence, d_model)
Mask = list[list[MaskBit]] | EncodedTensor  # (batch, length) of 0/1
Cache = list[list[list[list[FiniteFloat]]]] | EncodedTensor  # (batch, n_kv_heads, length, head_dim)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KeyValue(Strict):
    key: Cache = Field(description="(batch, n_kv_heads, past_length, head_dim) float32")
    value: Cache = Field(description="(batch, n_kv_heads, past_length, head_dim) float32")


class AttendRequest(Strict):
    hidden_states: States = Field(description="(batch, sequence, d_model) float32: the new tokens")
    attention_mask: Mask | None = Field(
        default=None, description="(batch, past_length + sequence) of 1 (attend) / 0 (padding); default all ones"
    )
    past_key_values: list[KeyValue] | None = Field(
        default=None, description="one {key, value} per layer, as returned in `present`; omit for an empty past"
    )


class AttendResponse(BaseModel):
    output: States = Field(description="(batch, sequence, d_model) float32")
    present: list[KeyValue] = Field(description="per layer, the past extended by the new tokens: send it back as past")


class StepBody(Strict):
    hidden_states: States = Field(description="(1, sequence, d_model) float32: the session's new tokens")
    attention_mask: Mask | None = Field(default=None, description="(1, sequence) of 1/0 for the new tokens only")


class StepResponse(BaseModel):
    output: States = Field(description="(1, sequence, d_model) float32")
    length: int = Field(description="tokens the server now holds for this session")


class SessionCreated(BaseModel):
    id: str = Field(description="the session's id, for /v1/sessions/{id}/step and DELETE")
    idle_timeout_s: float = Field(description="the session is closed after this long without a step")


class TensorDescription(BaseModel):
    name: str
    datatype: str = Field(description="Triton datatype, e.g. FP32, INT64")
    shape: list[int] = Field(description="-1 marks a dynamic axis")


class ModelDescription(BaseModel):
    name: str
    kind: Literal["stateless", "session"]
    ready: bool
    d_model: int | None = None
    n_layers: int | None = Field(default=None, description="layers (stateless model only)")
    n_kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None
    inputs: list[TensorDescription] = []
    outputs: list[TensorDescription] = []


class ModelList(BaseModel):
    models: list[ModelDescription]


class Status(BaseModel):
    status: str
