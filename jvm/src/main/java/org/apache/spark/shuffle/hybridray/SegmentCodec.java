package org.apache.spark.shuffle.hybridray;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.zip.CRC32C;

/**
 * The frame of one segment: a fixed header in front of the payload (bytes of one reduce
 * partition of one map attempt, as Spark's serializer and compression codec wrote them).
 *
 * <pre>
 *   0  magic "HRSG"            4 bytes
 *   4  version (1), 3 zero     4 bytes
 *   8  payload length          4 bytes, little endian
 *  12  CRC32C of the payload   4 bytes
 *  16  identity digest         8 bytes: (shuffle, map attempt, partition, index)
 * </pre>
 *
 * <p>The identity is bound into the header so that a segment served for the wrong block
 * (a stale location, a reused file name) fails verification instead of feeding another
 * map's rows to a reducer. CRC32C is hardware-accelerated in the JDK; Python never decodes
 * these segments, so they need not share the Python segments' XXH3 checksum.
 */
public final class SegmentCodec {
  public static final int MAGIC = 0x48525347; // "HRSG"
  public static final byte VERSION = 1;
  public static final int HEADER_BYTES = 24;

  private SegmentCodec() {}

  /** A 64-bit digest of a segment's identity (FNV-1a over its UTF-8 text, then mixed). */
  public static long identity(String shuffleKey, long mapId, int partition, int index) {
    byte[] text = (shuffleKey.length() + ":" + shuffleKey + "/" + mapId + "/" + partition + "/"
        + index).getBytes(StandardCharsets.UTF_8);
    long h = 0xcbf29ce484222325L;
    for (byte b : text) {
      h ^= (b & 0xff);
      h *= 0x100000001b3L;
    }
    // Murmur3's finaliser: spreads the FNV state over all 64 bits.
    h ^= h >>> 33;
    h *= 0xff51afd7ed558ccdL;
    h ^= h >>> 33;
    h *= 0xc4ceb9fe1a85ec53L;
    return h ^ (h >>> 33);
  }

  /**
   * Fill in the header of {@code frame}, whose payload occupies
   * {@code [HEADER_BYTES, HEADER_BYTES + payloadLength)}; returns {@code frame}.
   */
  public static byte[] seal(byte[] frame, int payloadLength, long identity) {
    if (payloadLength < 0 || HEADER_BYTES + payloadLength > frame.length) {
      throw new IllegalArgumentException("payload of " + payloadLength
          + " bytes does not fit a frame of " + frame.length + " bytes");
    }
    CRC32C crc = new CRC32C();
    crc.update(frame, HEADER_BYTES, payloadLength);
    ByteBuffer header = ByteBuffer.wrap(frame, 0, HEADER_BYTES).order(ByteOrder.LITTLE_ENDIAN);
    header.putInt(MAGIC).put(VERSION).put((byte) 0).put((byte) 0).put((byte) 0)
        .putInt(payloadLength).putInt((int) crc.getValue()).putLong(identity);
    return frame;
  }

  /** A frame holding {@code payload} (a copy), sealed: for callers that have the bytes. */
  public static byte[] encode(byte[] payload, long identity) {
    byte[] frame = new byte[HEADER_BYTES + payload.length];
    System.arraycopy(payload, 0, frame, HEADER_BYTES, payload.length);
    return seal(frame, payload.length, identity);
  }

  /**
   * Check a frame read back from a tier and return its payload length (the payload starts
   * at {@code HEADER_BYTES}). Throws {@link CorruptSegmentException} naming what is wrong.
   */
  public static int verify(byte[] frame, long expectedIdentity, String what)
      throws CorruptSegmentException {
    if (frame.length < HEADER_BYTES) {
      throw new CorruptSegmentException(what + ": " + frame.length
          + " bytes is shorter than a segment header (" + HEADER_BYTES + ")");
    }
    ByteBuffer header = ByteBuffer.wrap(frame, 0, HEADER_BYTES).order(ByteOrder.LITTLE_ENDIAN);
    int magic = header.getInt();
    byte version = header.get();
    header.position(8);
    int length = header.getInt();
    int checksum = header.getInt();
    long identity = header.getLong();
    if (magic != MAGIC || version != VERSION) {
      throw new CorruptSegmentException(what + ": not a hybrid_ray Spark segment (magic "
          + Integer.toHexString(magic) + ", version " + version + ")");
    }
    if (length != frame.length - HEADER_BYTES) {
      throw new CorruptSegmentException(what + ": header says " + length
          + " payload bytes, the segment holds " + (frame.length - HEADER_BYTES)
          + " (truncated or padded)");
    }
    if (identity != expectedIdentity) {
      throw new CorruptSegmentException(what + ": the segment belongs to another block "
          + "(identity mismatch): a stale or misplaced segment");
    }
    CRC32C crc = new CRC32C();
    crc.update(frame, HEADER_BYTES, length);
    if ((int) crc.getValue() != checksum) {
      throw new CorruptSegmentException(what + ": checksum mismatch (CRC32C "
          + Integer.toHexString((int) crc.getValue()) + ", header "
          + Integer.toHexString(checksum) + "): the data was corrupted in storage");
    }
    return length;
  }

  /** A segment failed verification on read. */
  public static final class CorruptSegmentException extends IOException {
    public CorruptSegmentException(String message) {
      super(message);
    }
  }
}
